"""A real vLLM engine in its own process, pinned to one core, replaying on request.

vLLM lives in its own environment (``make vllm``: ``.venv-vllm``), so the engine runs as a
subprocess of that environment's Python: this interpreter when it can import vLLM,
otherwise ``.venv-vllm/bin/python`` (or ``--vllm-python``). The process is pinned to one
core and runs its kernels there (``VLLM_CPU_OMP_THREADS_BIND``), so the steps it times are
not shared with this process, which fits and simulates between replays on another core.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from loadgen.fidelity.replay_loop import ReplayRequest, ReplayResult

DEFAULT_VLLM_PYTHON = Path(".venv-vllm/bin/python")
_LOG_TAIL_CHARS = 4000


def default_engine_core() -> int:
    """The last core this process may run on: the engine's own."""
    return max(os.sched_getaffinity(0))


def find_vllm_python(explicit: str | None) -> str:
    """The Python that runs the engine.

    Raises:
        SystemExit: naming the fix, when none can import vLLM.
    """
    if explicit:
        return explicit
    if importlib.util.find_spec("vllm") is not None:
        return sys.executable
    if DEFAULT_VLLM_PYTHON.exists():
        return str(DEFAULT_VLLM_PYTHON)
    raise SystemExit("vLLM is not installed here: run `make vllm` (or pass --vllm-python PATH)")


class VllmEngineProcess:
    """One engine process (a context manager): :meth:`replay` runs requests on it.

    ``engine_config``: the configuration vLLM settled on, as
    :class:`~blockq.engine_model.config.EngineConfig` fields.

    Raises:
        RuntimeError: with the end of the engine's log, when the process fails.
    """

    def __init__(self, engine_args: dict[str, Any], *, core: int, vllm_python: str | None = None) -> None:
        env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": str(core), "VLLM_LOGGING_LEVEL": "WARNING"}
        self._log = tempfile.NamedTemporaryFile(prefix="blockq-engine-", suffix=".log")  # noqa: SIM115
        self._process = subprocess.Popen(
            [find_vllm_python(vllm_python), "-m", "loadgen.fidelity.vllm_engine", json.dumps(engine_args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=env, text=True,
            preexec_fn=lambda: os.sched_setaffinity(0, {core}))
        self.engine_config: dict[str, Any] = self._read_reply()["engine_config"]

    def replay(self, requests: list[ReplayRequest]) -> ReplayResult:
        assert self._process.stdin is not None
        line = json.dumps([{**vars(r), "prompt_token_ids": list(r.prompt_token_ids)} for r in requests])
        try:
            self._process.stdin.write(line + "\n")
            self._process.stdin.flush()
        except BrokenPipeError:
            self._fail()
        return ReplayResult.from_dict(self._read_reply())

    def _read_reply(self) -> dict[str, Any]:
        assert self._process.stdout is not None
        line = self._process.stdout.readline()
        if not line:
            self._fail()
        return json.loads(line)

    def _fail(self) -> None:
        self._process.wait()
        tail = Path(self._log.name).read_text(errors="replace")[-_LOG_TAIL_CHARS:]
        raise RuntimeError(f"the vLLM engine process failed (exit {self._process.returncode}):\n{tail}")

    def close(self) -> None:
        if self._process.stdin is not None:
            self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()

    def __enter__(self) -> VllmEngineProcess:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
