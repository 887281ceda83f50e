"""`mopar run --containers`: each function of a bundle in a container of its own image.

A `ContainerSession` is the http chain of `mopar.runner.chain` with containers for processes:

- **Limits.** Each container gets the plan's allocation as its memory limit (no swap) and the
  plan's vCPU share as its CPU limit (at most the machine's cores); the kernel enforces both.
- **Co-location.** Functions the plan hands over by shm (`colocated`) share a tmpfs volume at
  the path their bundle names (``/dev/shm/mopar``), as on one Kubernetes node; the others talk
  HTTP over loopback (the containers share the host's network).
- **Memory.** A thread reads each container's cgroup peak (`cgroup_memory_file`) every
  `PEAK_POLL_S`. A container the kernel kills (exit 137) fails the requests it held; it is
  started again on its port, the kill is counted, and its error names the function, its
  allocation and its cgroup's peak.
- **Clean-up.** Every container is started with ``--rm`` and a run label, and `stop` removes
  the labelled containers and the volumes, also after Ctrl-C or a failure.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

from mopar.config import RunConfig
from mopar.container.engine import Engine, cgroup_memory_file
from mopar.errors import RuntimeFailure
from mopar.runner.bundle import BundleManifest
from mopar.runner.chain import AS_PLANNED, ChainSession
from mopar.runner.load import pct
from mopar.runner.processes import ServerProcess, free_port
from mopar.runner.report import RunReport
from mopar.runtime.handler import threads_for
from mopar.runtime.transports import handing_on, inline, shared

__all__ = ["ContainerSession", "colocated", "SHM_MOUNT", "PEAK_POLL_S"]

SHM_MOUNT = "/dev/shm/mopar"
"""Where a bundle's functions look for their shared tmpfs (``MOPAR_SHM_DIR`` in stack.yml)."""
PEAK_POLL_S = 0.02
"""How often the containers' cgroup memory peaks are read, s."""
_MB = 1024 * 1024


def colocated(manifest: BundleManifest) -> list[set[str]]:
    """The groups of functions the bundle's plan co-locates: those joined by shm edges."""
    plan = manifest.document.plan
    group: dict[str, set[str]] = {}
    for edge in plan.get("edges", ()):
        if handing_on(edge.get("transport") or "").colocated:
            a, b = edge["src"], edge["dst"]
            joined = group.get(a, {a}) | group.get(b, {b})
            for name in joined:
                group[name] = joined
    unique = {id(g): g for g in group.values()}
    return [g for g in unique.values() if len(g) > 1]


class ContainerSession(ChainSession):
    """A bundle served by containers of its images (see the module docstring).

    Args:
        images: function name -> image (`mopar.container.build`).
        transport: ``plan`` (shm between co-located functions, HTTP elsewhere), ``http`` or
            ``redis`` (every hop).
    """

    def __init__(
        self,
        manifest: BundleManifest,
        config: RunConfig,
        *,
        engine: Engine,
        images: dict[str, str],
        transport: str = AS_PLANNED,
        redis_url: str = "",
    ) -> None:
        super().__init__(manifest, config, transport=transport, redis_url=redis_url)
        self.engine = engine
        self.images = images
        self.run_id = secrets.token_hex(4)
        # the engine's working folder: podman's conmon writes a file named `oom` into it when
        # the kernel kills a container for memory; the pidfiles live here too
        self._work = Path(tempfile.mkdtemp(prefix=f"mopar-{self.run_id}-"))
        self.volumes: dict[str, str] = {}  # function -> its group's volume
        self.peak: dict[str, float] = {s.name: 0.0 for s in manifest.slices}  # bytes
        self.kills: dict[str, int] = {s.name: 0 for s in manifest.slices}
        self.starts: dict[str, list[float]] = {s.name: [] for s in manifest.slices}
        self.deaths: list[tuple[float, str]] = []  # (when its replacement was ready, message)
        self._files: dict[str, Path | None] = {}
        self._pidfiles: dict[str, Path] = {}
        self._containers: dict[str, str] = {}  # function -> its container's name
        self._count = 0
        self._restart = threading.Lock()
        self._stopping = threading.Event()
        self._env: dict[str, dict[str, str]] = {}
        self.plan = manifest.document.plan
        self.vcpus = {f["name"]: float(f.get("vcpus") or 1.0) for f in self.plan["functions"]}

    # --- start and stop -------------------------------------------------------------------------

    def start(self, *, wait: bool = True) -> None:
        self._sweep()
        if self.transport == AS_PLANNED:
            for k, names in enumerate(colocated(self.manifest)):
                volume = f"mopar-{self.run_id}-node{k}"
                labels = ["--label", f"com.mopar.run={self.run_id}"]
                labels += ["--label", f"com.mopar.pid={os.getpid()}"]
                tmpfs = "--opt type=tmpfs --opt device=tmpfs --opt o=mode=1777".split()
                self.engine.run("volume", "create", *labels, *tmpfs, volume)
                self.volumes.update({name: volume for name in names})
        threading.Thread(target=self._watch, daemon=True).start()
        super().start(wait=wait)

    def _cpus(self, name: str) -> float:
        """The CPU limit of ``name``'s container: its plan's share, at most this machine's."""
        return min(self.vcpus.get(name, 1.0), float(os.cpu_count() or 1))

    def _reserve(self, names: list[str]) -> dict[str, int]:
        """Each function's port: one a container on the host's network can bind itself."""
        return {name: free_port() for name in names}

    def _launch(self, s, env: dict[str, str]) -> ServerProcess:
        name = s.name
        if self.transport == AS_PLANNED:
            env["MOPAR_TRANSPORT"] = (shared() if name in self.volumes else inline()).name
        env["MOPAR_SHM_DIR"] = SHM_MOUNT
        if not self.config.intra_op_threads:  # onnxruntime's threads follow its CPU limit
            env["MOPAR_INTRA_OP"] = str(threads_for(self._cpus(name)))
        self._env[name] = env
        return self._start(s, env)

    def _start(self, s, env: dict[str, str]) -> ServerProcess:
        self._count += 1
        container = f"mopar-{self.run_id}-{s.name}-{self._count}"
        pidfile = self._work / f"{container}.pid"
        if s.name in self._pidfiles:  # the one of the container this one replaces
            self._pidfiles[s.name].unlink(missing_ok=True)
        self._pidfiles[s.name], self._files[s.name] = pidfile, None
        self._containers[s.name] = container
        memory = f"{s.memory_mb}m"
        args = ["run", "--rm", "--init", "--network", "host", "--name", container]
        args += ["--label", f"com.mopar.run={self.run_id}", "--memory", memory]
        args += ["--memory-swap", memory, "--cpus", f"{self._cpus(s.name):g}"]
        if self.engine.name == "podman":
            args += ["--pidfile", str(pidfile)]
        if s.name in self.volumes:
            args += ["-v", f"{self.volumes[s.name]}:{SHM_MOUNT}"]
        for key, value in env.items():
            args += ["-e", f"{key}={value}"]
        t0 = time.perf_counter()
        try:
            server = ServerProcess(
                self.engine.command(*args, self.images[s.name]),
                self.engine.environ(),
                s.name,
                self.config.timeout_s,
                cwd=self._work,
            )
        except RuntimeFailure as exc:
            if getattr(exc, "exit_code", None) == 137:
                raise RuntimeFailure(
                    f"function {s.name} was killed while starting: {self._oom_words(s.name)}"
                ) from None
            raise RuntimeFailure(f"{exc} (container {container})") from None
        self.starts[s.name].append((time.perf_counter() - t0) * 1e3)
        return server

    def _sweep(self) -> None:
        """Remove the volumes of runs whose mopar process is gone (killed with SIGKILL, which
        leaves no chance to clean up; their containers stopped with them)."""
        listed = self.engine.run(
            *"volume ls --filter label=com.mopar.pid --format".split(),
            '{{.Name}} {{index .Labels "com.mopar.pid"}}',
            check=False,
        )
        for line in listed.stdout.decode().splitlines():
            name, _, pid = line.partition(" ")
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                self.engine.run("volume", "rm", name, check=False)  # refused while in use

    def stop(self) -> None:
        self._stopping.set()
        listed = self.engine.run(
            "ps", "-aq", "--filter", f"label=com.mopar.run={self.run_id}", check=False
        )
        ids = listed.stdout.decode().split()
        if ids:
            self.engine.run("rm", "-f", "-t", "0", *ids, check=False, timeout_s=60)
        super().stop()
        for volume in sorted(set(self.volumes.values())):
            self.engine.run("volume", "rm", "-f", volume, check=False)
        shutil.rmtree(self._work, ignore_errors=True)

    # --- memory ---------------------------------------------------------------------------------

    def _watch(self) -> None:
        """Read each running container's cgroup peak every `PEAK_POLL_S`."""
        while not self._stopping.wait(PEAK_POLL_S):
            for name in list(self._pidfiles):
                f = self._files.get(name)
                if f is None:
                    f = self._files[name] = self._cgroup_file(name)
                if f is None:
                    continue
                try:
                    self.peak[name] = max(self.peak[name], float(f.read_text()))
                except (OSError, ValueError):
                    self._files[name] = None  # gone: the container stopped

    def _cgroup_file(self, name: str) -> Path | None:
        """The cgroup file of ``name``'s container: its PID from podman's ``--pidfile``, or
        from ``docker inspect``, which has no such option."""
        try:
            if self.engine.name == "docker":
                done = self.engine.run(
                    "inspect", "--format", "{{.State.Pid}}", self._containers[name], check=False
                )
                pid = int(done.stdout.decode().strip())
            else:
                pid = int(self._pidfiles[name].read_text().strip())
        except (OSError, ValueError):
            return None
        return cgroup_memory_file(pid) if pid > 0 else None

    def _oom_words(self, name: str) -> str:
        mb = next(s.memory_mb for s in self.manifest.slices if s.name == name)
        return (
            f"killed by the kernel for memory (exit 137) at its {mb} MB limit; its cgroup's "
            f"peak was {self.peak[name] / _MB:.0f} MB at the last reading; recompile the "
            "bundle on this machine (compile sizes each function at its measured peak x "
            "1.25), or give the function more memory"
        )

    # --- a container that died ------------------------------------------------------------------

    def _dead_server_check(self, since: float) -> str | None:
        """Start again each container that stopped, and count it; return what a request that
        began at ``since`` lost, if a container it may have reached stopped while it ran."""
        with self._restart:
            deadline = time.perf_counter() + 2.0  # the engine learns of a kill a little late
            while not (
                dead := [i for i, x in enumerate(self.servers) if x.proc.poll() is not None]
            ):
                if time.perf_counter() > deadline or self._stopping.is_set():
                    break
                time.sleep(0.05)
            for i in dead:
                old = self.servers[i]
                s = next(x for x in self.manifest.slices if x.name == old.name)
                code = old.proc.returncode
                if code == 137:
                    self.kills[s.name] += 1
                    why = f"{s.name}: {self._oom_words(s.name)}"
                else:
                    tail = next((x for x in reversed(old.stderr_tail) if x.strip()), "no output")
                    why = f"{s.name}: its container exited with code {code}: {tail}"
                self.servers[i] = self._start(s, {**self._env[s.name], "PORT": str(old.port)})
                self.deaths.append((time.perf_counter(), why))
            return next((why for ready, why in reversed(self.deaths) if ready >= since), None)

    def report(self, *, checked: bool) -> RunReport:
        base = super().report(checked=checked)
        slices = []
        for st, server in zip(base.slices, self.servers):
            starts = self.starts[st.name]
            slices.append(
                replace(
                    st,
                    peak_rss_mb=round(self.peak[st.name] / _MB, 1),
                    load_ms=round(server.session_ms, 1),
                    cold_starts=len(starts),
                    cold_start_ms=pct(starts, 50),
                    init_ms=round(sum(starts), 1),
                    oom_kills=self.kills[st.name],
                )
            )
        return replace(
            base,
            slices=tuple(slices),
            transport=f"containers ({self.transport})",
            served_by="container",
        )
