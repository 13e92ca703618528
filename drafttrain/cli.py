"""``drafttrain`` console script: ``drafttrain <command> key=value ...`` (Hydra overrides).

Commands:
  train         train a drafter (same as ``accelerate launch train.py ...``)
  eval          evaluate a saved drafter (``drafter=runs/<run>/final``) or ar/pld in the speculative decoder
  build-target  build (or find in the cache) the built-in target and print its path
  regenerate    rewrite assistant turns of a JSONL file with the target's own outputs (resumable; here with HF
                generate, or ``backend=openai base_url=… model=…`` through a vLLM / SGLang / transformers server)
  capture       store the target's hidden states for offline training (``capture.path=DIR``; resumable,
                multi-process under ``accelerate launch -m drafttrain.cli capture``)
  export        write a drafter for vLLM / SGLang / TensorRT-LLM / HF (``drafter=… format=vllm|sglang|trtllm|hf out=…``)
  bench         our decoder vs HF generate() / assisted / prompt lookup, and EAGLE-3 chain + tree (a table; rows
                ``methods=[…]``, decode settings ``decode.*``: ``decode.max_new_tokens=64 decode.repeats=5 …``)
  tune          pick decode.num_draft_tokens or decode.tree.total_tokens from measured acceptance and costs
                (``decode.num_prompts``, ``decode.max_new_tokens``: the calibration prompts)

Shorthands: ``target=<dir or hub name>`` (not a drafttrain/conf/target option) means ``target=hf
target.name_or_path=<it>``; ``data=<file>.jsonl`` means ``data=jsonl data.path=<file>``; ``data=<file>.parquet``,
``.arrow`` or ``data=<directory>`` means ``data=file data.path=<it>``; ``data=<org>/<name>`` means ``data=hub``.
Errors caused by input or state print one line (``error: ...``) and exit with status 2; a key an older release
had elsewhere (``eagle3.<lever>``, now ``eagle3.experimental.<lever>``; bench's and tune's ``max_new_tokens`` …,
now ``decode.*``) is refused naming its new key.
"""
from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Callable

# The Hydra configs ship inside the package (drafttrain/conf, recipes in drafttrain/conf/recipe), so a wheel
# install finds them from any working directory. In a checkout, top-level conf/ and recipes/ link here.
CONF_DIR = Path(__file__).resolve().parent / "conf"


def _group_options(group: str) -> set[str]:
    d = CONF_DIR / group
    return {p.stem for p in d.glob("*.yaml")} if d.is_dir() else set()


def expand_shorthands(overrides: list[str]) -> list[str]:
    out: list[str] = []
    for arg in overrides:
        key, eq, value = arg.partition("=")
        if eq and key == "target" and value and value not in _group_options("target"):
            out += ["target=hf", f"target.name_or_path={value}"]
        elif eq and key == "data" and value.endswith((".jsonl", ".json")):
            out += ["data=jsonl", f"data.path={value}"]
        elif eq and key == "data" and value and value not in _group_options("data"):
            out += _data_shorthand(arg, value)
        else:
            out.append(arg)
    return out


def _data_shorthand(arg: str, value: str) -> list[str]:
    """``data=<file>.parquet|.arrow`` or ``data=<directory>``: data=file; ``data=<org>/<name>`` (not a local
    path): data=hub; anything else is left to Hydra (an unknown data option)."""
    import os

    if value.endswith((".parquet", ".arrow")) or os.path.isdir(os.path.expanduser(value)):
        return ["data=file", f"data.path={value}"]
    if value.count("/") == 1 and not value.startswith((".", "/", "~")) and not os.path.exists(value):
        return ["data=hub", f"data.path={value}"]
    return [arg]


def known_failure(exc: BaseException) -> str | None:
    """The one-line message for an error caused by input or state, or None for a bug (keep its traceback).

    Input errors: DraftTrainError (the library's own checks), OmegaConf errors raised while the job reads its
    config, OS errors naming a file (missing, unreadable, a directory where a file was expected) and damaged
    safetensors files that a library read past the loaders' own checks."""
    from omegaconf.errors import OmegaConfBaseException
    from safetensors import SafetensorError

    from .io import DraftTrainError

    if isinstance(exc, DraftTrainError):
        return str(exc)
    if isinstance(exc, OmegaConfBaseException):
        return str(exc).strip().splitlines()[0]
    if isinstance(exc, OSError) and getattr(exc, "filename", None):
        return f"{exc.filename}: {exc.strerror or type(exc).__name__}"
    if isinstance(exc, SafetensorError):
        return f"a safetensors file is damaged ({str(exc).strip().splitlines()[0]})"
    return None


def _report_errors(fn: Callable) -> Callable:
    """Turn errors caused by input or state (``known_failure``) into one line and exit status 2."""

    @functools.wraps(fn)
    def wrapper(cfg):
        try:
            return fn(cfg)
        except Exception as e:
            message = known_failure(e)
            if message is None:
                raise
            _fail(message)

    return wrapper


def _describe_config_error(exc: BaseException, config_name: str = "") -> str:
    """One line for a composition error: which key, what is wrong, and a suggestion for a misspelled or moved key."""
    import difflib

    from hydra.errors import OverrideParseException
    from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

    from .config import moved_key

    if isinstance(exc, OverrideParseException):
        lines = [ln for ln in str(exc).splitlines() if ln and not ln.startswith(("Error parsing", "See https"))]
        key, _, value = str(exc.override).partition("=")
        return (f"cannot parse the override {exc.override!r} ({lines[0] if lines else 'syntax error'}): quote a "
                f"value that holds ( ) [ ] {{ }} , = ' \" or spaces, e.g. '{key}=\"{value}\"'")
    cause = exc
    while cause.__cause__ is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__
    full_key = getattr(cause, "full_key", None)
    if isinstance(cause, ConfigKeyError) and full_key and moved_key(config_name, str(full_key)):
        return _moved_message(str(full_key), moved_key(config_name, str(full_key)))
    if isinstance(cause, ConfigKeyError) and full_key:
        parent, _, leaf = str(full_key).rpartition(".")
        known = []
        node_type = getattr(cause, "object_type", None)
        if node_type is not None and hasattr(node_type, "__dataclass_fields__"):
            known = list(node_type.__dataclass_fields__)
        close = difflib.get_close_matches(leaf, known, n=1)
        hint = f" (did you mean '{(parent + '.') if parent else ''}{close[0]}'?)" if close else ""
        return f"unknown config key '{full_key}'{hint}"
    first = str(cause).strip().splitlines()[0] if str(cause).strip() else type(cause).__name__
    where = f"{full_key}: " if full_key else ""
    return f"{where}{first}"


def register_configs() -> None:
    """The structured schemas (drafttrain/config.py) in Hydra's ConfigStore: the primary configs' `defaults`
    name them (train_schema, …), so every composition is checked against its dataclass."""
    from hydra.core.config_store import ConfigStore

    from . import config as C

    cs = ConfigStore.instance()
    cs.store(name="train_schema", node=C.TrainJob)
    cs.store(name="eval_schema", node=C.EvalJob)
    cs.store(name="bench_schema", node=C.BenchJob)
    cs.store(name="tune_schema", node=C.TuneJob)
    cs.store(name="build_target_schema", node=C.BuildTargetJob)
    cs.store(name="regenerate_schema", node=C.RegenerateJob)
    cs.store(name="capture_schema", node=C.CaptureJob)
    cs.store(name="export_schema", node=C.ExportJob)
    cs.store(group="target", name="schema", node=C.TargetConfig)
    cs.store(group="data", name="schema", node=C.DataConfig)
    cs.store(group="decode", name="schema", node=C.DecodeConfig)
    cs.store(group="logger", name="schema", node=C.LoggerConfig)


register_configs()


def check_overrides(config_name: str, overrides: list[str], run_dir_override: list[str] = ()):
    """Compose the config once up front and check every value (drafttrain.validate), so a bad key, value or
    path is reported in one line (exit status 2) before the run directory exists or anything loads. Returns
    the composed job config and its run directory (hydra.run.dir, with ``run_dir_override`` applied)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf, open_dict

    from .io import DraftTrainError
    from .validate import check_job

    _refuse_renamed(config_name, overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            cfg = compose(config_name=config_name, overrides=[*overrides, *run_dir_override],
                          return_hydra_config=True)
            run_dir = OmegaConf.select(cfg, "hydra.run.dir")
            with open_dict(cfg):
                del cfg["hydra"]
    except Exception as e:  # hydra wraps every composition problem; report it as one line
        _fail(_describe_config_error(e, config_name))
    finally:
        GlobalHydra.instance().clear()
    try:
        check_job(config_name, cfg)
    except DraftTrainError as e:
        _fail(str(e))
    return cfg, run_dir


def _refuse_renamed(config_name: str, overrides: list[str]) -> None:
    """A recipe or method under the name an older release gave it (config.RENAMED_METHODS), or a key an older
    release had at another place (config.MOVED_KEYS): say the new name."""
    from .config import RENAMED_METHODS, moved_key

    for o in overrides:
        key, _, value = o.lstrip("+~").partition("=")
        if key in ("recipe", "method") and value in RENAMED_METHODS:
            _fail(f"{key}={value}: renamed {key}={RENAMED_METHODS[value]} (one name per drafter family: recipe, "
                  "method, drafter_type and decode.method)")
        new = moved_key(config_name, key)
        if new:
            _fail(_moved_message(key, new, value))


def _moved_message(key: str, new: str, value: str | None = None) -> str:
    shown = f"{key}={value}" if value else key
    return f"{shown}: this key is now {new} (write {new}={value or '…'})"


def _fail(message: str) -> None:
    _end_progress_bars()
    print(f"error: {message}".splitlines()[0], file=sys.stderr, flush=True)
    sys.exit(2)


def _end_progress_bars() -> None:
    """Close the progress bars a failed job left open, so the error starts a line of its own."""
    std = sys.modules.get("tqdm.std")
    for bar in list(getattr(getattr(std, "tqdm", None), "_instances", None) or ()):
        try:
            bar.close()
        except Exception:  # a bar that cannot close leaves only a longer line
            pass


# Hydra's own command-line flags whose value is the next argument (``--cfg job``, ``-p train``, ...);
# ``--info`` takes one optionally.
_HYDRA_FLAGS_WITH_VALUE = {"-c", "--cfg", "-p", "--package", "-cp", "--config-path", "-cn", "--config-name",
                           "-cd", "--config-dir", "--experimental-rerun"}
_HYDRA_INFO_VALUES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def _without_hydra_flags(args: list[str]) -> list[str]:
    """The overrides in ``args``: Hydra's flags (``--cfg job``, ``--info``, ``-m`` ...) and their values dropped."""
    out: list[str] = []
    it = iter(range(len(args)))
    for i in it:
        arg = args[i]
        if not arg.startswith("-"):
            out.append(arg)
        elif arg in _HYDRA_FLAGS_WITH_VALUE:
            next(it, None)
        elif arg in ("-i", "--info") and i + 1 < len(args) and args[i + 1] in _HYDRA_INFO_VALUES:
            next(it, None)
    return out


def run_hydra(config_name: str, task: Callable, overrides: list[str]) -> None:
    import hydra

    from .runtime import configure_cpu_threads, quiet_deepspeed_on_cpu

    overrides = expand_shorthands(overrides)
    checked = [o for o in _without_hydra_flags(overrides) if not o.startswith(("hydra.", "hydra/"))]
    explicit = [o for o in overrides if o.startswith("hydra.run.dir=")][-1:]
    cfg, run_dir = check_overrides(config_name, checked, explicit)
    if config_name in RUN_DIR_COMMANDS and all(not o.startswith("-") for o in overrides):  # not --cfg / --info / -m
        overrides = overrides + _settle_run_dir(config_name, cfg, run_dir, bool(explicit))
    configure_cpu_threads()
    quiet_deepspeed_on_cpu()
    sys.argv = [sys.argv[0]] + overrides
    main = hydra.main(config_path=str(CONF_DIR), config_name=config_name, version_base="1.3")(_report_errors(task))
    main()


RUN_DIR_COMMANDS = ("train", "eval", "bench", "tune")  # the commands that write into hydra.run.dir


def _settle_run_dir(config_name: str, cfg, run_dir: str, explicit: bool) -> list[str]:
    """Before Hydra creates the run directory: an explicit one that holds an earlier run is refused, or moved
    aside when the job asks (drafttrain.rundir); a default one is claimed new (``-2``, … when a launch in the
    same second took it) and handed to Hydra as ``hydra.run.dir``."""
    import os

    from .io import DraftTrainError
    from .rundir import claim_new_dir, guard_run_dir

    try:
        if not explicit:
            return [f"hydra.run.dir={claim_new_dir(run_dir)}"]
        if config_name == "train":
            resume, overwrite = cfg.train.resume, bool(cfg.train.overwrite)
        else:
            resume, overwrite = None, bool(cfg.overwrite)
        guard_run_dir(config_name, run_dir, resume=resume, overwrite=overwrite,
                      main=os.environ.get("RANK", "0") == "0", say=lambda m: print(m, flush=True))
    except DraftTrainError as e:
        _fail(str(e))
    return []


def _train_task(cfg):
    from .training.loop import run_train

    return run_train(typed_job(cfg), hydra_run_dir())


def typed_job(cfg):
    """The typed job (the config.py dataclass) of a composed config: what library entry points take."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(cfg)


def hydra_run_dir() -> Path:
    """The run directory Hydra made for this job (hydra.run.dir)."""
    from hydra.core.hydra_config import HydraConfig

    return Path(HydraConfig.get().runtime.output_dir)


def _with_saved_drafter(job):
    """``job`` with ``job.drafter`` a saved drafter directory: a training checkpoint (``step_*``) is rebuilt into
    its ``drafter/`` first (``training.checkpoint.drafter_dir``), so eval and export take checkpoints directly."""
    if job.drafter:
        from .training.checkpoint import drafter_dir

        job.drafter = str(drafter_dir(job.drafter))
    return job


def _eval_task(cfg):
    from .evaluation import run_eval

    return run_eval(_with_saved_drafter(typed_job(cfg)), hydra_run_dir())


def _build_target_task(cfg):
    from .targets.load import resolve_target_path

    job = typed_job(cfg)
    if job.target.name_or_path != "builtin":
        from .io import DraftTrainError

        raise DraftTrainError("build-target builds the built-in target only (target=builtin)")
    print(resolve_target_path(job.target))


def _regenerate_task(cfg):
    from .data.regenerate import describe_stats, regenerate_file

    job = typed_job(cfg)
    if job.backend == "openai":
        from .data.regenerate_openai import ServerSettings, regenerate_file_with_server

        server = ServerSettings(
            base_url=job.base_url, model=job.model, max_new_tokens=job.max_new_tokens, temperature=job.temperature,
            top_p=job.top_p, seed=job.seed, drop_truncated=job.drop_truncated, concurrency=job.concurrency,
            retries=job.retries, retry_backoff=job.retry_backoff, timeout=job.request_timeout,
        )
        stats = regenerate_file_with_server(server, job.input, job.output)
    else:
        from .targets.load import load_target

        model, tokenizer, _ = load_target(job.target)
        stats = regenerate_file(
            model, tokenizer, job.input, job.output, batch_size=job.batch_size, max_new_tokens=job.max_new_tokens,
            temperature=job.temperature, top_p=job.top_p, seed=job.seed, drop_truncated=job.drop_truncated,
        )
    print(f"[drafttrain] {describe_stats(stats)} -> {job.output}", flush=True)


def _capture_task(cfg):
    from .capture.capture import run_capture_job

    return run_capture_job(typed_job(cfg))


def _export_task(cfg):
    from .export import run_export

    return run_export(_with_saved_drafter(typed_job(cfg)))


def _bench_task(cfg):
    from .evaluation import run_bench

    return run_bench(typed_job(cfg), hydra_run_dir())


def _tune_task(cfg):
    from .evaluation import run_tune

    return run_tune(typed_job(cfg), hydra_run_dir())


COMMANDS = {
    "train": ("train", _train_task),
    "eval": ("eval", _eval_task),
    "build-target": ("build_target", _build_target_task),
    "regenerate": ("regenerate", _regenerate_task),
    "capture": ("capture", _capture_task),
    "export": ("export", _export_task),
    "bench": ("bench", _bench_task),
    "tune": ("tune", _tune_task),
}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(__doc__)
        return
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"error: unknown command {cmd!r}; expected one of: {', '.join(COMMANDS)}", file=sys.stderr)
        sys.exit(2)
    config_name, task = COMMANDS[cmd]
    run_hydra(config_name, task, rest)


if __name__ == "__main__":
    main()
