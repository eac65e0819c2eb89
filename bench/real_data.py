"""The data of files against the plain loops of the field, side by side on the same files (made
here: PNGs in ImageFolder's layout, a token file from numpy), one torch thread, the sides
interleaved round by round (who goes first alternating); ratios are medians over the rounds' pairs (samples/s, lightfleet over
the plain side). Results: bench/real_data.json.

- loaders: an epoch of lightfleet's data=imagefolder training loader against torchvision's
  ImageFolder in a DataLoader (shuffle=True, the same transforms and workers); data=tokens' random
  windows against nanoGPT's get_batch (a memmap, random starts, torch.stack).
- training: lightfleet training torchvision's ResNet-18 on the images and transformers' GPT-2
  (shrunk) on the tokens, against a hand-written PyTorch loop over the same model class, data
  loader, optimizer and batch (samples/s over the steps after warm-up).

    python bench/real_data.py                  # 3 rounds
    python bench/real_data.py --repeats 5
    python bench/real_data.py --only loader    # the loaders alone
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Dict, List

import numpy as np
import torch
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # runner/, bench/ and tests/ when lightfleet is not installed
from bench.spawning import machine  # noqa: E402
from runner.data.images import IMAGENET_MEAN, IMAGENET_STD, ImageFolderData  # noqa: E402
from runner.data.tokens import TokenFileData  # noqa: E402
from tests.helpers.data_files import image_folder  # noqa: E402

IMAGE_SIZE, IMAGES_PER_CLASS, IMAGE_BATCH, WORKERS = 56, 512, 32, 1  # an epoch of 32 batches
SEQ_LEN, TOKEN_BATCH, TOKEN_BATCHES = 256, 12, 400
TRAIN_STEPS, WARMUP = 40, 10
RESNET = ["model=vision", "model.arch=resnet18", "model.num_classes=2", "data=imagefolder",
          f"data.image_size={IMAGE_SIZE}", f"data.batch_size={IMAGE_BATCH}", f"data.num_workers={WORKERS}",
          "model.warmup_steps=0", "model.lr_decay=none"]
GPT = ["model=causal_lm", "data=tokens", "model.vocab_size=512", "model.d_model=128", "model.n_layers=2",
       "model.n_heads=4", f"data.seq_len={SEQ_LEN}", f"data.batch_size={TOKEN_BATCH}", "model.warmup_steps=0",
       "model.lr_decay=none"]
QUIET = ["logger=none", "callbacks=none", "trainer.enable_checkpointing=false", "trainer.enable_progress_bar=false",
         f"measure.warmup_steps={WARMUP}", f"trainer.max_steps={TRAIN_STEPS}", "trainer.val_check_interval=null",
         "trainer.limit_val_batches=0"]


def make_files(folder: Path) -> Dict[str, Path]:
    image_folder(folder / "images", per_class=IMAGES_PER_CLASS, size=64)
    (np.arange(2_000_000) * 7 % 509).astype(np.uint16).tofile(folder / "train.bin")
    (np.arange(20_000) % 509).astype(np.uint16).tofile(folder / "val.bin")
    return {"images": folder / "images", "train_bin": folder / "train.bin", "val_bin": folder / "val.bin"}


def samples_per_s(batches: Callable[[], Any]) -> float:
    """Samples a second over every batch `batches()` yields (its first batch, the workers' start, left out)."""
    iterator = iter(batches())
    first = next(iterator)
    count, start = 0, time.perf_counter()
    for inputs, _ in iterator:
        count += len(inputs)
    del first
    return count / (time.perf_counter() - start)


def lightfleet_images(files: Dict[str, Path]) -> float:
    data = ImageFolderData(str(files["images"]), image_size=IMAGE_SIZE, batch_size=IMAGE_BATCH, num_workers=WORKERS)
    return samples_per_s(data.train_dataloader)


def torchvision_images(files: Dict[str, Path]) -> float:
    from torchvision import datasets, transforms

    train = transforms.Compose([transforms.RandomResizedCrop(IMAGE_SIZE), transforms.RandomHorizontalFlip(),
                                transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)])
    dataset = datasets.ImageFolder(str(files["images"] / "train"), transform=train)
    return samples_per_s(lambda: torch.utils.data.DataLoader(dataset, batch_size=IMAGE_BATCH, shuffle=True,
                                                             num_workers=WORKERS, persistent_workers=True))


def lightfleet_tokens(files: Dict[str, Path]) -> float:
    data = TokenFileData(str(files["train_bin"]), str(files["val_bin"]), seq_len=SEQ_LEN, batch_size=TOKEN_BATCH,
                         samples_per_epoch=TOKEN_BATCH * TOKEN_BATCHES)
    return samples_per_s(data.train_dataloader)


def nanogpt_tokens(files: Dict[str, Path]) -> float:
    def get_batch():  # nanoGPT's train.py: a new memmap every batch, to avoid a memory leak
        for _ in range(TOKEN_BATCHES):
            data = np.memmap(files["train_bin"], dtype=np.uint16, mode="r")
            starts = torch.randint(len(data) - SEQ_LEN, (TOKEN_BATCH,))
            x = torch.stack([torch.from_numpy(data[i:i + SEQ_LEN].astype(np.int64)) for i in starts])
            y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + SEQ_LEN].astype(np.int64)) for i in starts])
            yield x, y

    return samples_per_s(get_batch)


def lightfleet_training(files: Dict[str, Path], overrides: List[str], workdir: Path) -> float:
    import subprocess

    run = workdir / f"run{time.monotonic_ns()}"
    done = subprocess.run([sys.executable, "-m", "runner", *overrides, *QUIET, f"paths.output_dir={run}"],
                          cwd=workdir, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        sys.exit(f"bench: lightfleet {' '.join(overrides)} failed:\n{done.stderr[-2000:]}")
    return yaml.safe_load((run / "results.yaml").read_text())["samples_per_s"]


def hand_loop(model: torch.nn.Module, loader: Any, optimizer: torch.optim.Optimizer) -> float:
    """A plain PyTorch loop: forward, cross-entropy, backward, step; samples/s after WARMUP steps."""
    model.train()
    batches, step, count, start = iter(loader), 0, 0, 0.0
    while step < TRAIN_STEPS:
        try:
            inputs, targets = next(batches)
        except StopIteration:
            batches = iter(loader)
            continue
        logits = model(inputs)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        if step == WARMUP:
            start = time.perf_counter()
        elif step > WARMUP:
            count += len(inputs)
    return count / (time.perf_counter() - start)


def hand_resnet(files: Dict[str, Path]) -> float:
    from runner.models.vision import VisionClassifier

    torch.manual_seed(0)
    model = VisionClassifier("resnet18", num_classes=2, image_size=IMAGE_SIZE)
    data = ImageFolderData(str(files["images"]), image_size=IMAGE_SIZE, batch_size=IMAGE_BATCH, num_workers=WORKERS)
    return hand_loop(model, data.train_dataloader(), torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9,
                                                                     weight_decay=1e-4))


def hand_gpt(files: Dict[str, Path]) -> float:
    from runner.models.causal_lm import CausalLM

    torch.manual_seed(0)
    model = CausalLM(vocab_size=512, seq_len=SEQ_LEN, d_model=128, n_layers=2, n_heads=4)
    data = TokenFileData(str(files["train_bin"]), str(files["val_bin"]), seq_len=SEQ_LEN, batch_size=TOKEN_BATCH)
    return hand_loop(model, data.train_dataloader(), torch.optim.AdamW(model.parameters(), lr=6e-4,
                                                                       betas=(0.9, 0.95), weight_decay=0.1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--only", default="", help="run the comparisons whose name holds this text (e.g. loader)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        files = make_files(Path(folder))
        work = Path(folder)
        data_args = {"resnet": [f"data.root={files['images']}"],
                     "gpt": [f"data.train_bin={files['train_bin']}", f"data.val_bin={files['val_bin']}"]}
        pairs: Dict[str, tuple] = {
            "imagefolder loader / torchvision loop": (lambda: lightfleet_images(files), lambda: torchvision_images(files)),
            "tokens loader / nanoGPT get_batch": (lambda: lightfleet_tokens(files), lambda: nanogpt_tokens(files)),
            "lightfleet ResNet-18 training / hand loop": (
                lambda: lightfleet_training(files, RESNET + data_args["resnet"], work), lambda: hand_resnet(files)),
            "lightfleet GPT-2 (shrunk) training / hand loop": (
                lambda: lightfleet_training(files, GPT + data_args["gpt"], work), lambda: hand_gpt(files)),
        }
        pairs = {name: sides for name, sides in pairs.items() if args.only in name}
        rounds: Dict[str, List[tuple]] = {name: [] for name in pairs}
        for round_ in range(args.repeats):
            for name, (ours, theirs) in pairs.items():
                if round_ % 2:  # who goes first alternates: a cache the first one warms serves the second
                    theirs_first = theirs()
                    rounds[name].append((ours(), theirs_first))
                else:
                    rounds[name].append((ours(), theirs()))
                print(f"round {round_ + 1}: {name}: {rounds[name][-1][0]:.1f} vs {rounds[name][-1][1]:.1f} samples/s",
                      flush=True)
    summary = {name: {"ratio": statistics.median(a / b for a, b in measured),
                      "pairs": [a / b for a, b in measured], "samples_per_s": measured} for name, measured in rounds.items()}
    for name, figures in summary.items():
        print(f"{name}: ratio {figures['ratio']:.3f} (pairs {min(figures['pairs']):.3f}-{max(figures['pairs']):.3f})")
    # With --only, the other comparisons' figures stay as an earlier run wrote them.
    results_file = ROOT / "bench" / "real_data.json"
    earlier = json.loads(results_file.read_text())["results"] if args.only and results_file.exists() else {}
    results_file.write_text(json.dumps({"when": datetime.now(timezone.utc).isoformat(), "machine": machine(),
                                        "results": {**earlier, **summary}}, indent=1))


if __name__ == "__main__":
    main()
