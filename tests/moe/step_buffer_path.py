"""The GPU's step-input path (reused step buffers, one upload a step) run eagerly on the CPU, for
tests: the runner takes the buffers as on CUDA, and since the CPU attention reference reads the
decode rows' host layout, that is added to the buffers' metadata. Returns a list that records, per
upload, whether the batch had pending input ids (async scheduling)."""
from __future__ import annotations


def force_step_buffers(monkeypatch) -> list[bool]:
    import moe.worker.model_runner as mr
    import moe.worker.step_inputs as si
    monkeypatch.setattr(mr, "use_triton_attention", lambda x: True)
    pending: list[bool] = []
    upload = si.upload

    def upload_with_decode_rows(buf, batch, block_size, padded=None, metadata=True, num_valid=None):
        pending.append(batch.pending_src_T is not None and bool((batch.pending_src_T >= 0).any()))
        meta = upload(buf, batch, block_size, padded, metadata, num_valid)
        if meta is not None and batch.decode_only:
            si._add_decode_rows(meta.group_metas or [meta], batch, buf.device, block_size)
        return meta
    monkeypatch.setattr(mr, "upload", upload_with_decode_rows)
    return pending
