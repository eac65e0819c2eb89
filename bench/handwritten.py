"""The hand-written Lightning script that `bench/run.py` races lightfleet against: the same model,
data, trainer settings, loggers and checkpointing as `lightfleet experiment=quickstart`, with no
lightfleet code in the loop (only the built-in model and data classes, which are plain Lightning).

    python bench/handwritten.py --steps 300 --out handwritten-run [--progress-bar]

Its validation cadence is the quickstart's (trainer.val_check_interval: 16), so that both sides do
the same work; --progress-bar keeps Lightning's default bar on, as a user's script has it.
"""
import argparse
import sys
from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.loggers import CSVLogger

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # runner/ when lightfleet is not installed
from runner.data import SyntheticClassificationData  # noqa: E402
from runner.models import MLPClassifier  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--progress-bar", action="store_true", help="Lightning's default progress bar on")
    args = parser.parse_args()

    pl.seed_everything(0, workers=True, verbose=False)
    model = MLPClassifier(input_dim=32, hidden_dim=64, num_blocks=3, num_classes=4,
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    data = SyntheticClassificationData(input_shape=[32], num_classes=4, num_train=2048, num_val=512,
                                       batch_size=64, seed=0)
    trainer = pl.Trainer(accelerator="auto", devices=1, max_steps=args.steps, log_every_n_steps=10,
                         val_check_interval=16, num_sanity_val_steps=0, enable_progress_bar=args.progress_bar,
                         logger=CSVLogger(args.out, name="", version="csv"),
                         callbacks=[ModelCheckpoint(dirpath=f"{args.out}/checkpoints", save_last=True)],
                         default_root_dir=args.out)
    trainer.fit(model, datamodule=data)


if __name__ == "__main__":
    main()
