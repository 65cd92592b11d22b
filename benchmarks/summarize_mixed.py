"""Print the headline figures of a gpu_engine_bench.py JSON holding mixed_step / mixed runs:
`python3 benchmarks/summarize_mixed.py engine_mixed.json`."""
import json
import sys


def main(path: str) -> None:
    results = json.load(open(path))
    for key, r in results.items():
        if not isinstance(r, dict) or "steps" not in r:
            continue
        steps = r["steps"]
        fields = ("steps", "eager_steps", "mean_ms", "device_mean_ms", "floor_over_device")
        kinds = {k: {f: v[f] for f in fields if f in v} for k, v in steps.items() if k != "launch_only"}
        head = {f: round(r[f], 3) for f in ("elapsed_s", "output_tok_s", "floor_over_time") if f in r}
        print(key, json.dumps(head), json.dumps(kinds))


if __name__ == "__main__":
    main(sys.argv[1])
