"""A Hydra job under any launcher: what it knows of itself, its run dir (one per run), its errors.

Hydra resolves `${now:...}` in every process, so torchrun ranks reaching Hydra a second apart would each create a
run dir (hydra #2070): run dirs are named with `${run_timestamp:FORMAT}`, rank 0's clock shared through the
launcher's store, and ranks other than 0 skip writing `.hydra/` (`${main_rank_only:}`). Importing this module
registers those resolvers and `${data:FIELD}`, so every process that composes the config has them."""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, MutableMapping, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import OmegaConf

from src.common.errors import UsageError, exit_on_usage_error, find_usage_error
from src.config import data_fields, hydra_errors
from src.parallel import distributed
from src.parallel.ranks import adopt_cluster_env, in_multi_task_job, is_main_process, is_worker, read_env

STARTED_AT = "DDP_TEMPLATE_RUN_STARTED_AT"  # the run's start time: set once per process, inherited by its children


@dataclass(frozen=True)
class RunContext:
    """What a job knows of itself from Hydra, read once where it starts and passed down."""

    run_dir: Path
    created: bool  # the run dir held nothing but Hydra's files when the job started: this run made it
    in_sweep: bool  # a job of a multirun (-m)
    overrides: tuple[str, ...]  # the command line's overrides of the config (not Hydra's own)
    choices: Mapping[str, Any]  # the option Hydra chose in each config group
    composing: tuple[str, ...] = ()  # what composes the config besides `overrides` (composing_args)

    def resume_args(self, *dropped: str) -> str:
        """The arguments that continue this run, for a shell: `composing`, the overrides but `dropped`, the run dir."""
        kept = [o for o in self.overrides if not o.startswith(("resume=", *dropped))]
        return shlex.join([*self.composing, *kept, "resume=auto", f"hydra.run.dir={self.run_dir}"])

    @classmethod
    def of(cls, hydra_cfg: Any, argv: Sequence[str] = sys.argv) -> "RunContext":
        run_dir = Path(hydra_cfg.runtime.output_dir)
        return cls(run_dir, holds_only_hydras_files(run_dir), hydra_cfg.mode == RunMode.MULTIRUN,
                   tuple(hydra_cfg.overrides.task), dict(hydra_cfg.runtime.choices), composing_args(hydra_cfg, argv))


CONFIG_FLAGS = ("--config-path", "-cp", "--config-name", "-cn", "--config-dir", "-cd")  # Hydra's


def composing_args(hydra_cfg: Any, argv: Sequence[str] = sys.argv) -> tuple[str, ...]:
    """What composes the config besides its overrides: Hydra's flags in `argv` that choose the config's folders and
    file (each with its value), hydra.searchpath."""
    flags: list[str] = []
    for index, arg in enumerate(argv):
        if arg.split("=", 1)[0] in CONFIG_FLAGS:
            flags += [arg] if "=" in arg else [arg, *argv[index + 1:index + 2]]
    return (*flags, *(o for o in hydra_cfg.overrides.hydra if o.split("=", 1)[0].lstrip("+") == "hydra.searchpath"))


def run(main: Callable[[], Any], config_name: str) -> None:
    """Run an entry point's `@hydra.main` `main`: config errors as one line, a worker ended after its group."""
    try:
        with hydra_errors.one_line_config_errors(is_main_process(), config_name):
            main()
    finally:  # the dirs `fresh_dir` made that no run used (OmegaConf resolves the default's run dir as it merges a
        for made in _made_here:  # preset's onto it), gone with their parent (the date) while empty, after an error too
            with contextlib.suppress(OSError):
                made.rmdir()
                made.parent.rmdir()
    if is_worker():
        distributed.exit_after_a_group()


def start() -> RunContext:
    """Where a job starts: a submitit or `srun` task becomes a torchrun-style worker; its context, read once."""
    hydra_errors.config_composed()
    adopt_cluster_env()
    return RunContext.of(HydraConfig.get())


@contextlib.contextmanager
def usage_errors(context: RunContext) -> Iterator[None]:
    """A usage error in the block is one `error:` line and exit code 2, and the run dir it leaves unused goes."""
    with exit_on_usage_error(is_main_process(), context.in_sweep), \
            discard_unused_run_dir(context.run_dir, context.created, context.in_sweep):
        yield


def _agreed(variable: str, decide: Callable[[], str], environ: MutableMapping[str, str] = os.environ) -> str:
    """`decide()` as rank 0 made it, on every rank: agreed once through the launcher's store (a restarted rank 0 finds
    its first value there), then kept in `variable` of the environment the processes it starts inherit."""
    if variable not in environ:
        env = read_env(environ)
        store, key = distributed.rendezvous_store(env) if env.is_distributed else None, f"ddp_template/{variable}"
        if store is None or env.is_main_process and not store.check([key]):
            environ[variable] = decide()
            if store is not None:
                store.set(key, environ[variable])
        else:
            environ[variable] = store.get(key).decode()
    return environ[variable]


def run_started_at(environ: MutableMapping[str, str] = os.environ) -> datetime.datetime:
    """The run's start time (rank 0's), the same in every process of the run."""
    return datetime.datetime.fromisoformat(_agreed(STARTED_AT, lambda: datetime.datetime.now().isoformat(), environ))


def fresh_dir(path: str, environ: MutableMapping[str, str] = os.environ) -> str:
    """`path`, or the first of `path-2`, `path-3`, ... that no other run has made (rank 0 makes it here), the same in
    every process of the run: runs started in the same second never share a dir. Tasks of an `srun` job keep `path`."""
    variable = f"DDP_TEMPLATE_DIR_{hashlib.sha1(path.encode()).hexdigest()[:12]}"
    if variable not in environ and in_multi_task_job(environ) and not is_worker(environ):  # not adopted yet
        return path
    return _agreed(variable, lambda: _made(path), environ)


_made_here: list[Path] = []  # the dirs `fresh_dir` made in this process


def _made(path: str, number: int = 1) -> str:
    candidate = path if number == 1 else f"{path}-{number}"
    check_run_dir(Path(candidate))
    try:
        Path(candidate).mkdir(parents=True)  # atomic: of runs racing for a dir, one makes it
    except FileExistsError:
        return _made(path, number + 1)
    except FileNotFoundError:  # its parent made, then removed by another run as unused: again
        return _made(path, number)
    _made_here.append(Path(candidate))
    return candidate


def check_run_dir(run_dir: Path) -> None:
    """One line, not a mkdir traceback, for a run dir below a file or in a folder this user cannot write."""
    found = next(folder for folder in [run_dir, *run_dir.parents] if folder.exists())
    if not (found.is_dir() and os.access(found, os.W_OK | os.X_OK)):
        problem = "not writable by this user" if found.is_dir() else "not a folder"
        raise UsageError(f"cannot make {run_dir}, the folder of this run's files: {found} is {problem}")


def register_resolvers() -> None:
    """The config's `${run_timestamp:FORMAT}`, `${fresh_dir:PATH}`, `${main_rank_only:VALUE}` and `${data:FIELD}`."""
    OmegaConf.register_new_resolver("run_timestamp", lambda fmt: run_started_at().strftime(fmt), replace=True)
    OmegaConf.register_new_resolver("fresh_dir", fresh_dir, replace=True)
    # Hydra writes `.hydra/` before our code runs, in every process: `hydra.output_subdir` is null on the other ranks.
    OmegaConf.register_new_resolver("main_rank_only", lambda value: value if is_main_process() else None, replace=True)
    data_fields.register_resolver()  # ${data:FIELD} in model YAMLs


def holds_only_hydras_files(run_dir: Path) -> bool:
    """Whether `run_dir` holds nothing but Hydra's `.hydra/` (so this run made it)."""
    return all(path.name == ".hydra" for path in run_dir.iterdir()) if run_dir.is_dir() else True


@contextlib.contextmanager
def discard_unused_run_dir(run_dir: Path, created: bool, in_sweep: bool) -> Iterator[None]:
    """On a usage error, remove the run dir this run `created` if it holds only `.hydra/` and logs (never a sweep's
    job dir, nor under a launcher: another rank may still write its log)."""
    try:
        yield
    except Exception as error:
        unused = created and all(path.name == ".hydra" or path.suffix == ".log" for path in run_dir.iterdir())
        if find_usage_error(error) is not None and not (in_sweep or is_worker()) and unused:
            shutil.rmtree(run_dir, ignore_errors=True)
            stop = Path.cwd().resolve()  # and the folders above it (outputs/DATE/) left empty, up to here
            for parent in run_dir.resolve().parents:
                if parent == stop or stop not in parent.parents or any(parent.iterdir()):
                    break
                parent.rmdir()
        raise


def quote_override(value: str) -> str:
    """Quote a value for Hydra's override grammar (paths may hold characters it parses)."""
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


register_resolvers()
