"""`lightfleet rehearse` against published runs (issue 42): torchtitan's Llama 3 70B and 8B on 64
A100 80 GB (docs/performance.md, its Llama 3 table, mid-2024), the fit and the out-of-memory run
docs/rehearse.md cites, and the 405B run that fit (FSDP + TP 8). Each is rehearsed for real (the
rank side on fake tensors, for the device the run used); the rank's report is fed to
runner/core/prediction.py with the model's FLOPs (no recompute: MFU) and set beside the published
figures.

    python bench/rehearsal_published.py                 # every run: bench/rehearsal_published.json
    python bench/rehearsal_published.py --runs llama3_8b  # that run's entry replaced, the others kept

A 70B rehearsal takes about a minute of CPU, a 405B's about two (the figures say how long each
took, in wall and CPU seconds), so these runs stay here and not in the tests
(tests/runner/test_rehearse_formula.py rehearses the 8B).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/ when lightfleet is not installed

# Llama 3's sizes (Meta's model cards), untied head, one sequence of 8,192 tokens a rank, bfloat16
# parameters gathered, float32 gradients reduced (torchtitan's FSDP2 defaults), FSDP over all ranks.
LLAMA = ["model=causal_lm", "model.family=llama", "model.n_kv_heads=8", "model.tie_embeddings=false",
         "data=language_model", "data.num_val=8", "data.num_test=8", "strategy.amp.dtype=bfloat16",
         "strategy.sharding.stage=3"]
LLAMA3 = [*LLAMA, "model.vocab_size=128256", "data.batch_size=1", "data.num_train=128"]
SIZES_8B = ["model.d_model=4096", "model.n_layers=32", "model.n_heads=32", "model.ffn_dim=14336"]
SIZES_70B = ["model.d_model=8192", "model.n_layers=80", "model.n_heads=64", "model.ffn_dim=28672"]
A100_64 = ["trainer.devices=8", "trainer.num_nodes=8", "rehearse.device=a100"]
# Llama 3.1 405B (its model card) on torchtitan's 128 H100s of "94GB memory" (its docs/performance.md:
# Grand Teton hosts, HBM2e), local batch 2 of 8,192 tokens, every layer checkpointed.
LLAMA31_405B = [*LLAMA, "model.vocab_size=128256", "data.batch_size=2", "data.num_train=512", "model.d_model=16384",
                "model.n_layers=126", "model.n_heads=128", "model.ffn_dim=53248", "trainer.devices=8",
                "trainer.num_nodes=16", "rehearse.device=h100", "rehearse.device_memory_gb=94", "data.seq_len=8192"]
EVERY_OTHER_8B = "strategy.recompute.checkpoints=[" + ",".join(f"lm.model.layers.{i}" for i in range(0, 32, 2)) + "]"

# name: (overrides, what was published)
RUNS: Dict[str, Any] = {
    "llama3_8b": ([*LLAMA3, *SIZES_8B, *A100_64, "data.seq_len=8192", "strategy=[amp,recompute,sharding]",
                   EVERY_OTHER_8B],
                  {"fits": True, "tokens_per_s_per_gpu": 2904, "mfu": 0.568}),
    "llama3_70b": ([*LLAMA3, *SIZES_70B, *A100_64, "data.seq_len=8192", "strategy=[amp,recompute,sharding]"],
                   {"fits": True, "tokens_per_s_per_gpu": 331, "mfu": 0.517}),
    "llama3_70b_no_recompute": ([*LLAMA3, *SIZES_70B, *A100_64, "data.seq_len=8192", "strategy=[amp,sharding]"],
                                {"fits": False}),
    # docs/rehearse.md's two more: Llama 2 70B (vocabulary 32,000, no grouped-query attention in
    # the 7B/13B, 8 key/value heads in the 70B), local batch 2 of 4,096 tokens, every layer
    # checkpointed: fits (353 tokens/s, MFU 50.5%); Llama 3.1 405B on 128 H100 under FSDP alone,
    # local batch 2, every layer checkpointed: out of memory.
    "llama2_70b_batch2": ([*LLAMA, "model.vocab_size=32000", "data.batch_size=2", "data.num_train=256", *SIZES_70B,
                           *A100_64, "data.seq_len=4096", "strategy=[amp,recompute,sharding]"],
                          {"fits": True, "tokens_per_s_per_gpu": 353, "mfu": 0.505}),
    "llama31_405b_fsdp_only": ([*LLAMA31_405B, "strategy=[amp,recompute,sharding]"], {"fits": False}),
    # torchtitan's 405B row that ran: FSDP 16 x TP 8 (109 tokens/s per GPU, MFU 29.0%, its H100s at
    # 500 W). lightfleet's tensor parallelism is torchtitan's plan without sequence parallelism.
    "llama31_405b_fsdp_tp8": ([*LLAMA31_405B, "strategy=[amp,recompute,sharding]", "strategy.sharding.mp_degree=8"],
                              {"fits": True, "tokens_per_s_per_gpu": 109, "mfu": 0.29}),
}


def model_flops_per_token(overrides: List[str]) -> float:
    """The model's training FLOPs a token without recompute (runner/models/causal_lm.py's count),
    the model built on the meta device."""
    import torch
    from hydra.utils import instantiate

    from runner.config.checks import validate
    from runner.config.compose import compose_config

    with torch.device("meta"):
        return instantiate(validate(compose_config(overrides)).cfg.model, _convert_="all").flops_per_token


def rehearse(name: str, out: Path) -> Dict[str, Any]:
    from runner.core.prediction import load_devices, predict
    from runner.core.world import Layout

    overrides, published = RUNS[name]
    started, cpu = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    done = subprocess.run([sys.executable, "-m", "runner", "rehearse", *overrides, f"paths.output_dir={out / name}"],
                          cwd=ROOT, capture_output=True, text=True)
    seconds = time.time() - started
    used = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_seconds = used.ru_utime + used.ru_stime - cpu.ru_utime - cpu.ru_stime  # the command's and its rank's
    record = yaml.safe_load((out / name / "rehearsal.yaml").read_text())
    kind = record["ranks"][0]
    report = kind["report"]
    device = load_devices()[record["device"]["name"]]
    layout = Layout(**record["layout"])
    # This rank's share of the model's FLOPs: its tokens through the whole model, split over the ranks
    # of its tensor-parallel group and pipeline, which read the same tokens.
    model_flops = model_flops_per_token(overrides) * report["tokens_per_step"] / (layout.tp * layout.pp)
    prediction = predict(report, device, layout, model_flops=model_flops)
    result = {"published": published, "exit_status": done.returncode, "fits": record["fits"],
              "needs_gib": kind["needs_bytes"] / 2 ** 30, "peak_gib": kind["peak_bytes"] / 2 ** 30,
              "memory_gib": record["device"]["memory_gb"],
              "parts_gib": {part: value / 2 ** 30 for part, value in report["memory"].items()},
              "tokens_per_s_per_gpu": prediction.tokens_per_s_per_gpu, "mfu": prediction.mfu,
              "step_s": prediction.step_s, "compute_s": prediction.compute_s, "memory_s": prediction.memory_s,
              "exposed_communication_s": prediction.exposed_communication_s,
              "rank_seconds": report["seconds"], "seconds": seconds, "cpu_seconds": cpu_seconds, "last_line": done.stderr.strip().splitlines()[-1:]}
    if published.get("tokens_per_s_per_gpu"):
        result["tokens_per_s_off"] = prediction.tokens_per_s_per_gpu / published["tokens_per_s_per_gpu"] - 1
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "rehearsal_published.json")
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory(prefix="lightfleet-published-") as scratch:
        for name in args.runs:
            results[name] = rehearse(name, Path(scratch))
            one = results[name]
            rate = f"{one['tokens_per_s_per_gpu']:,.0f} tokens/s per GPU, MFU {one['mfu']:.1%}"
            print(f"{name}: fits={one['fits']} (published {one['published']['fits']}), needs {one['needs_gib']:.1f} "
                  f"GiB (activations {one['parts_gib']['activations']:.1f}), {rate} (published "
                  f"{one['published'].get('tokens_per_s_per_gpu')}), rehearsed in {one['seconds']:.0f} s "
                  f"({one['cpu_seconds']:.0f} s of CPU)", flush=True)
            earlier = json.loads(args.out.read_text()) if args.out.is_file() else {}  # the runs not run now kept
            args.out.write_text(json.dumps({**earlier, **results}, indent=1))


if __name__ == "__main__":
    main()
