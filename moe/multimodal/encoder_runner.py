"""The model runner's image side: runs the vision encoder over the images the scheduler lists for
a step, keeps each image's features in its request's state until the scheduler frees them, and
builds a step's input embeddings with the features at the image-token positions of each chunk
(the first pipeline stage only).

Legend: T tokens of the step, D hidden size.
"""
from __future__ import annotations

import numpy as np
import torch

from moe.multimodal.shm_transport import pixels_of
from moe.worker.step_inputs import RequestState, StepBatch
from scheduler import SchedulerOutput


class EncoderRunner:
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        # Requests holding image features (a step of theirs embeds them instead of ids).
        self.holding: set[str] = set()

    def encode(self, so: SchedulerOutput, requests: dict[str, RequestState], dtype: torch.dtype) -> None:
        """The encoder over every image scheduled this step, in one batch of tiles."""
        owners, pixels = [], []
        for req_id, indices in so.scheduled_encoder_inputs.items():
            state = requests[req_id]
            self.holding.add(req_id)
            for index in indices:
                owners.append((state, index))
                pixels.append(pixels_of(state.mm_items[index].pixel_values))  # shared memory is read here
        features = self.model.encode_images(torch.cat(pixels).to(self.device, dtype))
        for (state, index), f in zip(owners, features.split([s.mm_items[i].num_embeds for s, i in owners])):
            state.encoder_outputs[index] = f

    def free(self, req_id: str, state: RequestState | None, index: int | None = None) -> None:
        """Drop one image's features (index) or the request's state altogether (None)."""
        if state is not None and index is not None:
            state.encoder_outputs.pop(index, None)
            if state.encoder_outputs:
                return
        self.holding.discard(req_id)

    def inputs_embeds(self, batch: StepBatch, input_ids_T: torch.Tensor) -> torch.Tensor | None:
        """[T, D] token embeddings with the image features of this step's chunks (None when no
        chunk touches an image: the model embeds the ids itself)."""
        rows, picks = [], []
        for b, state in enumerate(batch.states):
            if not state.encoder_outputs:
                continue
            start = state.num_computed_tokens
            end, row0 = start + int(batch.num_tokens_B[b]), int(batch.query_start_loc[b])
            for index, features in state.encoder_outputs.items():
                positions = self.embed_positions(state, index)
                inside = np.nonzero((positions >= start) & (positions < end))[0]
                if len(inside):
                    rows.append(positions[inside] - start + row0)
                    picks.append(features[torch.from_numpy(inside).to(features.device)])
        if not rows:
            return None
        embeds_TD = self.model.embed_input_ids(input_ids_T)
        embeds_TD[torch.from_numpy(np.concatenate(rows)).to(embeds_TD.device)] = torch.cat(picks).to(embeds_TD.dtype)
        return embeds_TD

    def embed_positions(self, state: RequestState, index: int) -> np.ndarray:
        """Prompt positions of an image's feature tokens (the model's image token inside its span)."""
        item = state.mm_items[index]
        span = np.asarray(state.token_ids[item.offset:item.end])
        positions = item.offset + np.nonzero(span == self.model.image_token_id)[0]
        if len(positions) != item.num_embeds:
            raise ValueError(f"an image's span holds {len(positions)} image tokens, but its encoder gives "
                             f"{item.num_embeds} features")
        return positions
