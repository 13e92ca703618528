"""Train a drafter: ``accelerate launch train.py recipe=eagle3 [target=…] [data=…] [key=value …]``.

The recipe (recipes/<name>.yaml) says what is trained; every key of drafttrain/config.py can be overridden
on the command line. Runs write into the Hydra run directory (``hydra.run.dir=…``; default runs/<method>-<time>).
"""
import sys

from drafttrain.cli import _train_task, run_hydra

if __name__ == "__main__":
    run_hydra("train", _train_task, sys.argv[1:])
