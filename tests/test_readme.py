"""Every `lightfleet` command the README shows, taken from the README itself and run in its order
in one directory, as a newcomer would run them: with the files its examples name (a corpus and a
tokenizer, an ImageFolder tree, a config directory holding a model written here, with nested
blocks and batch norm), shortened to a few steps and shrunk models where the README's sizes are a
GPU's. A command the README shows refused must be refused with the very line it shows."""
from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from tests.helpers.data_files import bpe_tokenizer, documents, image_folder
from tests.helpers.user_code import USER_MODEL

README = Path(__file__).resolve().parent.parent / "README.md"
SHORT = ["trainer.max_steps=2", "trainer.enable_progress_bar=false"]
# The README's GPU-sized experiments, shrunk as their first lines say.
SHRUNK = {
    "experiment=gpt2_124m": ["model.d_model=64", "model.n_layers=2", "model.n_heads=4", "data.seq_len=32",
                             "strategy.gradient_merge.k_steps=1", "data.batch_size=4", "model.warmup_steps=1",
                             "fast_path.compile=false"],
    "experiment=resnet50_fleet_collective": ["model.arch=resnet18", "data.image_size=32", "data.batch_size=4",
                                             "data.num_workers=0", "model.warmup_steps=1", "trainer.devices=1"],
}
def readme_commands() -> list[str]:
    """The `lightfleet` lines of the README's bash blocks, comments cut off, in order."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(), flags=re.S)
    lines = [line.split("  #")[0].strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith("lightfleet")]


def shown_refusal(command: str) -> str:
    """The refusal the README shows for `command`: a plain block holding one `lightfleet: refused`
    or `lightfleet: error` line, right after the bash block that `command` ends."""
    text = README.read_text()
    for block in re.finditer(r"```bash\n(.*?)```\n", text, flags=re.S):
        lines = [line.split("  #")[0].strip() for line in block.group(1).splitlines() if line.strip()]
        if lines and lines[-1] == command:
            shown = re.match(r"(?:(?!```).)*?```\n(lightfleet: (?:refused|error): [^\n]+)\n```", text[block.end():],
                             flags=re.S)
            return shown.group(1) if shown else ""
    return ""


def newcomers_files(folder: Path) -> None:
    texts = documents(300)
    (folder / "corpus").mkdir()
    for index in range(3):
        (folder / "corpus" / f"part{index}.txt").write_text("".join(texts[index::3]))
    bpe_tokenizer(folder / "tokenizer.json", texts)
    image_folder(folder / "imagenet", per_class=8)
    (folder / "mypackage.py").write_text(USER_MODEL)
    for group, body in (("model", "_target_: mypackage.UserNet\nwidth: 32\n"),
                        ("data", "_target_: runner.data.SyntheticClassificationData\ninput_shape: [32]\n"
                                 "num_classes: 4\nbatch_size: 16\n")):
        (folder / "my_configs" / group).mkdir(parents=True)
        (folder / "my_configs" / group / f"my_{group}.yaml").write_text(body)


def test_the_readme_shows_commands(tmp_path):
    commands = readme_commands()
    assert len(commands) >= 15 and all("lightfleet " in c or c == "lightfleet" for c in commands)


@pytest.mark.slow
def test_every_command_the_readme_shows_runs_as_it_says(lightfleet, tmp_path):
    newcomers_files(tmp_path)
    for command in readme_commands():
        args = shlex.split(command)[1:]
        refusal = shown_refusal(command)
        trains = not args or "=" in args[0] or args[0] in ("resume", "replay", "-m", "--config-dir")
        extra = [o for key, shrink in SHRUNK.items() if key in args for o in shrink]
        if trains and not any(arg.startswith("trainer.max_steps=") for arg in args):
            extra += SHORT
        elif trains:
            extra.append("trainer.enable_progress_bar=false")
        done = lightfleet(*args, *extra, timeout=900)
        if refusal:
            assert done.returncode == 2 and done.stderr.strip() == refusal, (command, done.stderr[-2000:])
        else:
            assert done.returncode == 0, (command, extra, done.stderr[-3000:])
