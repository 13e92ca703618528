"""Evaluation: the speculative decoder measured against AR decoding on a target.

- job.py: ``evaluate`` (prepare -> measure -> sweep -> report), ``evaluate_drafter`` (a loaded drafter's
  proposer; the training loop's evaluations), ``add_sampled_row``, ``run_eval`` (``drafttrain eval``);
- measure.py: the decoders (``prepare``) and the timed passes (``measure``, ``sweep``);
- report.py: ``build_report``, ``write_report`` (report.json, table, plots);
- batch_sweep.py: ``decode.batch_sizes`` (speedup against batch size beside its prediction);
- evalsets.py: the rows a decoding job reads (``eval_conversations``), question sets turn by turn, per category;
- bench.py: ``drafttrain bench`` / ``tune`` (our decoder against Hugging Face generation; K / tree size).

Each module uses the others' public names only.
"""
from .bench import run_bench, run_tune
from .evalsets import eval_conversations
from .job import add_sampled_row, evaluate, evaluate_drafter, run_eval

__all__ = ["evaluate", "evaluate_drafter", "add_sampled_row", "run_eval", "run_bench", "run_tune", "eval_conversations"]
