"""Thread and kernel-mode settings that must be in place before numpy (OpenBLAS) or ggml
(OpenMP) load.

On small machines OpenBLAS' idle threads and ggml's OpenMP threads busy-wait against each
other: alternating numpy and ggml calls made a 1-row ggml matmul 30x slower in a probe. A short
OpenBLAS thread timeout fixes it. ggml's OpenMP team keeps libgomp's default spin, as llama.cpp
runs: its per-node barriers are ``omp barrier``, and with a short GOMP_SPINCOUNT a waiting thread
sleeps and, on cores shared with another busy process, waits for the scheduler at every node
(llama.cpp's prefill at half speed; see bench/engine.py).

The kernel mode (env ``KVASIR_KERNEL_MODE``: ``fast``, the default, or ``deterministic``) decides
``GGML_CPU_TILED_MM``, which ggml's CPU backend reads once when it loads:

- ``fast``: llama.cpp's default kernels. From 8 rows on, a K-quant weight goes to the "tiled"
  kernel, which sums in another order than the one-row kernel, so a token's logits depend on
  what else is in its batch (and on how many tokens of a batch chose the same expert).
- ``deterministic``: batch-invariant. ``GGML_CPU_TILED_MM=0`` keeps every K-quant product on one
  kernel whatever the batch size, and ``kernels/ggml.py`` runs one-row dense products as two
  rows (tinyBLAS, like a prompt batch), so every sequence gets exactly its logits alone.

llama.cpp in the same process (the reference of ``kvasir verify``) loads the same libggml-cpu
and so runs with the same setting. The mode wins over a ``GGML_CPU_TILED_MM`` set by hand.
"""

import os

ENV_MODE = "KVASIR_KERNEL_MODE"
ENV_THREADS = "KVASIR_THREADS"
MODES = ("fast", "deterministic")

DEFAULTS = {
    "OPENBLAS_THREAD_TIMEOUT": "4",
}


def kernel_mode() -> str:
    """``fast`` or ``deterministic``, from env KVASIR_KERNEL_MODE (default fast)."""
    value = os.environ.get(ENV_MODE, "").strip().lower() or "fast"
    if value not in MODES:
        raise ValueError(f"{ENV_MODE}={value!r}: expected fast or deterministic")
    return value


def set_kernel_mode(mode: str) -> None:
    """Record ``mode`` in the environment (inherited by the worker processes this one starts)
    and set ggml's switch for it. Takes effect only if ggml has not loaded yet: callers go
    through ``kernels.backend.set_mode``, which checks that."""
    if mode not in MODES:
        raise ValueError(f"unknown kernel mode {mode!r}: expected fast or deterministic")
    os.environ[ENV_MODE] = mode
    os.environ["GGML_CPU_TILED_MM"] = "0" if mode == "deterministic" else "1"


def set_threads(n: int) -> None:
    """Threads per ggml call in this process and the processes it starts (env KVASIR_THREADS)."""
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    os.environ[ENV_THREADS] = str(n)


def default_threads(local_processes: int = 1) -> int:
    """Threads per ggml call when ``local_processes`` compute processes share this machine:
    the cores split between them, at least one each, so that their OpenMP teams do not spin
    against each other for the same cores."""
    return max(1, (os.cpu_count() or 1) // max(1, local_processes))


#: The subcommands whose processes run ggml on this machine's cores.
COMPUTE_COMMANDS = ("worker", "serve", "up", "generate")


def usable_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def _is_compute(argv: list[str]) -> bool:
    """``kvasir worker ...`` / ``python -m kvasir_bus.cli serve ...`` and the like."""
    for i, arg in enumerate(argv[:4]):
        base = os.path.basename(arg)
        if base == "kvasir" or arg == "kvasir_bus.cli":
            return i + 1 < len(argv) and argv[i + 1] in COMPUTE_COMMANDS
    return False


def compute_processes(proc: str = "/proc") -> int:
    """Kvasir compute processes running on this machine, this one included (at least 1).
    Read from ``/proc/*/cmdline``; where there is no /proc, 1."""
    count, me = 0, os.getpid()
    try:
        entries = os.listdir(proc)
    except OSError:
        return 1
    for name in entries:
        if not name.isdigit() or int(name) == me:
            continue
        try:
            with open(os.path.join(proc, name, "cmdline"), "rb") as f:
                argv = f.read(4096).decode("utf-8", "replace").split("\0")
        except OSError:  # gone, or not ours to read
            continue
        count += _is_compute(argv)
    return count + 1


def shared_threads(processes: int | None = None, cores: int | None = None) -> int:
    """Threads per ggml call so that the compute processes on this machine, each running this
    many, do not ask for more threads than there are cores (one at least)."""
    processes = compute_processes() if processes is None else processes
    cores = usable_cores() if cores is None else cores
    return max(1, cores // max(1, processes))


def oversubscribed(threads: int | None = None, processes: int | None = None, cores: int | None = None) -> bool:
    """Whether this machine's compute processes, at ``threads`` each (default: this process's
    KVASIR_THREADS), ask for more threads than it has cores: their OpenMP teams then wait for
    each other's time slices at every barrier."""
    if threads is None:
        threads = int(os.environ.get(ENV_THREADS) or usable_cores())
    processes = compute_processes() if processes is None else processes
    cores = usable_cores() if cores is None else cores
    return threads * processes > cores


def threads_over_share() -> bool:
    """Whether this process runs more ggml threads (KVASIR_THREADS, else every core) than its
    share of the cores beside the machine's other kvasir compute processes: its OpenMP team
    then spins against theirs. At one thread each, more processes than cores is not flagged:
    nothing a node could lower."""
    mine = int(os.environ.get(ENV_THREADS) or usable_cores())
    return mine > shared_threads()


#: Cores' worth of CPU that other processes may use before this one gives up a thread: a little
#: background (a shell, a log shipper) costs a team of every core nothing measurable; more, and a
#: descheduled member stalls the team at every barrier.
OTHERS_SLACK = 0.3
#: How often :class:`CoreShare` looks at the other processes' load (seconds).
LOAD_PERIOD_S = 0.25


def free_threads(cores: int, others_busy: float | None) -> int:
    """Threads that fit the cores other processes leave free: ``others_busy`` cores' worth of
    CPU used by them (None: unknown, every core), at least one."""
    if others_busy is None:
        return cores
    return max(1, min(cores, int(cores - others_busy + OTHERS_SLACK)))


class CpuUse:
    """How many cores' worth of CPU the *other* processes of this machine used since the last
    reading: the machine's busy time (``/proc/stat``) less this process's own (``os.times``),
    over the wall time between. OpenMP's spinning threads count as this process's, so a team
    waiting at its barriers never reads as someone else's load. None where there is no /proc."""

    MIN_WINDOW_S = 0.1

    def __init__(self, stat: str = "/proc/stat"):
        self.stat = stat
        self._tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._last = self._read()

    def _read(self) -> tuple[float, float, float] | None:
        import time

        try:
            with open(self.stat) as f:
                fields = [int(v) for v in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        if len(fields) < 5:
            return None
        idle = fields[3] + fields[4]  # idle, iowait
        busy = (sum(fields[:8]) - idle) / self._tick  # user..steal, seconds
        own = os.times()
        return busy, own.user + own.system, time.monotonic()

    def restart(self) -> None:
        """Start the next window now."""
        self._last = self._read()

    def others(self) -> float | None:
        now = self._read()
        last, self._last = self._last, now
        if now is None or last is None or now[2] - last[2] < self.MIN_WINDOW_S:
            return None  # (a window of a few clock ticks says nothing)
        return max(0.0, ((now[0] - last[0]) - (now[1] - last[1])) / (now[2] - last[2]))


def runnable_others(stat: str = "/proc/stat", tasks: str = "/proc/self/task") -> int | None:
    """Threads of other processes runnable on this machine right now: the kernel's count of
    runnable threads (``procs_running`` in ``/proc/stat``) less this process's own (state R in
    ``/proc/self/task/*/stat``). None where there is no /proc. One look, not an average: it
    says whether someone else is busy at this instant, which :class:`CpuUse`'s windows cannot
    (they say what the last quarter second was)."""
    try:
        with open(stat) as f:
            running = next((int(line.split()[1]) for line in f if line.startswith("procs_running ")), None)
        if running is None:
            return None
        own = 0
        for tid in os.listdir(tasks):
            try:
                with open(os.path.join(tasks, tid, "stat")) as f:
                    own += f.read().rpartition(")")[2].split(None, 1)[0] == "R"
            except OSError:  # that thread has ended
                continue
    except (OSError, ValueError, IndexError):
        return None
    return max(0, running - own)


class CoreShare:
    """Keeps this process's ggml threads (env KVASIR_THREADS, read at every ggml call) at its
    share of the cores while other processes start and stop beside it: a hand-started worker
    sees the workers started after it (its share of the cores between the kvasir compute
    processes), and any process sees what else keeps the cores busy (:class:`CpuUse`: a test
    suite, a compiler, a phone's other apps) and runs no more threads than the cores left free
    (:func:`free_threads`). An OpenMP team wider than the free cores waits for a time slice at
    every barrier of every graph: on 2 cores shared with a busy test run, ``kvasir serve``
    decoded 16 streams at 22-34 tok/s with two threads and 170-350 with one. A daemon thread
    re-counts the kvasir processes every ``period_s`` (it reads every process's command line)
    and looks at the others' load every ``load_period_s`` (two small reads): a burst of other
    work costs a thread for about that long, not for a whole ``period_s`` after it ended
    (``bench/throughput.py`` runs llama.cpp between our runs: with a 2 s look, most of a run
    that followed one ran on one thread of two). The thread count never changes a result."""

    def __init__(self, period_s: float = 2.0, load_period_s: float = LOAD_PERIOD_S):
        import threading

        self.period_s, self.threads, self.processes, self.others_busy = period_s, 1, 1, None
        self.load_period_s = min(load_period_s, period_s)
        self._use = CpuUse()
        self._lock = threading.Lock()  # update (its thread) and waking (a server's) set the threads
        self._stop = threading.Event()
        self.update()
        self._thread = threading.Thread(target=self._run, name="kvasir-core-share", daemon=True)
        self._thread.start()

    def update(self, recount: bool = True) -> int:
        """Re-read the others' load (and with ``recount`` the kvasir processes) and set this
        process's threads; returns them."""
        with self._lock:
            return self._update(recount)

    def _update(self, recount: bool) -> int:
        before = self.threads if hasattr(self, "_thread") else None
        processes_before = self.processes
        if recount:
            self.processes = compute_processes()
        self.others_busy = self._use.others()
        cores = usable_cores()
        self.threads = min(shared_threads(self.processes, cores), free_threads(cores, self.others_busy))
        os.environ[ENV_THREADS] = str(self.threads)
        if before is not None and self.threads != before:  # (the first share: the start line's business)
            import structlog

            if not structlog.is_configured():  # not yet: structlog's default would print on stdout
                return self.threads

            # A change of kvasir processes is news for the operator; one of other programs' load
            # comes and goes with them, and would write a line every period on a busy machine.
            level = "info" if self.processes != processes_before else "debug"
            busy = None if self.others_busy is None else round(self.others_busy, 2)
            getattr(structlog.get_logger("kvasir.threads"), level)(
                "threads_shared", threads=self.threads, kvasir_processes=self.processes, cores=cores,
                others_busy_cores=busy)
        return self.threads

    def waking(self) -> int:
        """This process goes from idle to work (a server's first step after a quiet spell):
        where it runs fewer threads than its share because others were busy in the last look
        (:class:`CpuUse` saw the quarter second before), and no other process is runnable now
        (:func:`runnable_others`), it takes its share back at once and starts a new window, so
        that the next look judges only what happens from here. Without it, a server that
        starts work the moment a busy neighbour stops (a benchmark's other side, a finished
        build) ran its first quarter second on one thread of two: all of a short request.
        A neighbour that is still busy keeps the share where it is. Returns the threads."""
        with self._lock:
            share = shared_threads(self.processes, usable_cores())
            if self.threads >= share or runnable_others() != 0:
                return self.threads
            self.threads, self.others_busy = share, None
            os.environ[ENV_THREADS] = str(share)
            self._use.restart()
            return share

    def _run(self) -> None:
        import time

        first = min(self.period_s, 0.25)  # the first look at the other processes, soon after start
        if not self._stop.wait(first):
            try:
                self.update()
            except Exception:
                pass
        counted = time.monotonic()
        while not self._stop.wait(self.load_period_s):
            recount = time.monotonic() - counted >= self.period_s
            try:
                self.update(recount)
            except Exception:  # a /proc hiccup: keep the last share
                pass
            if recount:
                counted = time.monotonic()

    def stop(self) -> None:
        self._stop.set()


_share: CoreShare | None = None


def share_cores(period_s: float = 2.0) -> CoreShare | None:
    """Start (once) keeping this process's threads at its share of the cores; see CoreShare.
    A KVASIR_THREADS set before (by hand, or by ``kvasir up`` for its children) wins: None."""
    global _share
    if _share is None and os.environ.get(ENV_THREADS):
        return None
    if _share is None:
        _share = CoreShare(period_s)
    return _share


def waking() -> None:
    """Tell this process's :class:`CoreShare`, if it keeps one, that work starts after a quiet
    spell (:meth:`CoreShare.waking`)."""
    if _share is not None:
        _share.waking()


def add_kernel_flags(p, *, deterministic: bool = True) -> None:
    """``--deterministic`` and ``--threads N`` on a command that computes (applied by
    ``kernels.backend.apply_kernel_flags`` before anything loads ggml)."""
    if deterministic:
        p.add_argument("--deterministic", action="store_true",
                       help="batch-invariant kernels: each sequence gets exactly the logits it gets "
                       "alone, whatever else is batched (default: llama.cpp's faster default kernels)")
    p.add_argument("--threads", type=int, default=None, metavar="N",
                   help="threads per ggml call (default: env KVASIR_THREADS, else this machine's "
                   "cores split between the compute processes started here; a worker re-counts "
                   "the kvasir processes on its machine every 2 s and takes its share)")


for _key, _value in DEFAULTS.items():
    os.environ.setdefault(_key, _value)
try:
    set_kernel_mode(kernel_mode())
except ValueError:  # reported where the mode is read (kernels.backend), with the flag to fix it
    pass
