"""Hand-started workers split the cores: each counts the kvasir compute processes on its machine."""

from __future__ import annotations

import os
import time

from kvasir_bus import threads


def fake_proc(tmp_path, cmdlines: dict[int, list[str]]):
    for pid, argv in cmdlines.items():
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "cmdline").write_bytes("\0".join(argv).encode() + b"\0")
    (tmp_path / "self").mkdir()  # not a pid
    return str(tmp_path)


def test_counts_the_kvasir_compute_processes_only(tmp_path):
    proc = fake_proc(tmp_path, {
        101: ["/work/.venv/bin/python", "/work/.venv/bin/kvasir", "worker", "--nats", "x", "--model", "m"],
        102: ["/usr/bin/python3", "-m", "kvasir_bus.cli", "worker", "--node", "w2"],
        103: ["kvasir", "serve", "--model", "m", "--http", ":0"],
        104: ["kvasir", "status", "--nats", "x"],         # asks the market: no ggml
        105: ["/usr/bin/bash", "-c", "echo kvasir worker"],  # mentions it, is not it
        106: ["nats-server", "-p", "0"],
    })
    assert threads.compute_processes(proc) == 3 + 1  # the three, and this process
    assert threads.compute_processes(str(tmp_path / "absent")) == 1


def test_the_share_never_asks_for_more_threads_than_cores():
    assert threads.shared_threads(processes=1, cores=2) == 2
    assert threads.shared_threads(processes=4, cores=2) == 1  # three workers and a backbone
    assert threads.shared_threads(processes=3, cores=16) == 5
    assert not threads.oversubscribed(threads=1, processes=2, cores=2)
    assert threads.oversubscribed(threads=2, processes=4, cores=2)


def test_core_share_sets_this_process_threads_and_a_launcher_setting_wins(monkeypatch):
    monkeypatch.delenv(threads.ENV_THREADS, raising=False)
    share = threads.CoreShare(period_s=3600)
    try:
        assert os.environ[threads.ENV_THREADS] == str(share.threads)
        assert share.threads == threads.shared_threads(share.processes)
        assert 1 <= share.threads <= threads.usable_cores()
    finally:
        share.stop()
    monkeypatch.setenv(threads.ENV_THREADS, "3")
    monkeypatch.setattr(threads, "_share", None)
    assert threads.share_cores() is None  # KVASIR_THREADS (or --threads) set by hand: kept
    assert os.environ[threads.ENV_THREADS] == "3"


def test_an_oversubscribed_node_says_so_in_its_heartbeat_and_kvasir_status_shows_it():
    from kvasir_bus.codec import Heartbeat, decode_heartbeat
    from kvasir_bus.market_codec import MarketStatus, NodeStatus, decode_status_reply
    from kvasir_bus.wire import Holding
    from market.coverage import CoverageMap
    from market.show import status_json, status_text

    fp = "0123456789abcdef"
    beat = dict(model=fp, node="w-1", holdings=((0, 0, 8),), budget_bytes=1 << 20, load=0.0, served=0,
                version="0.1.0", kernel="ggml", sent_at=1.0)
    calm, busy = Heartbeat(**beat), Heartbeat(**beat, oversubscribed=True)
    assert "oversubscribed" not in calm.body()  # an unflagged heartbeat keeps the old bytes
    assert decode_heartbeat(busy.encode()).oversubscribed and not decode_heartbeat(calm.encode()).oversubscribed

    cov = CoverageMap(expiry_s=10.0, grace_s=5.0)
    cov.observe(busy, now=1.0)
    assert [e.oversubscribed for e in cov.nodes()] == [True]  # the market keeps what the node said

    def status(flag: bool) -> MarketStatus:
        node = NodeStatus("w-1", (Holding(0, 0, 8),), (), 1 << 20, 0.0, 0, 1.0, "0.1.0", "ggml",
                          oversubscribed=flag)
        return MarketStatus(model=fp, market="market", sent_at=1.0, manifest_known=False, n_layer=1,
                            n_expert=8, range_experts=8, expiry_s=10.0, nodes=(node,), demand=(), totals=())

    st = decode_status_reply(status(True).encode())
    assert st.nodes[0].oversubscribed and status_json(st)["nodes"][0]["oversubscribed"]
    assert "[cores oversubscribed]" in status_text(st)
    assert "oversubscribed" not in status_text(status(False))


def test_threads_fit_the_cores_other_processes_leave_free():
    assert threads.free_threads(2, None) == 2  # unknown: every core
    assert threads.free_threads(2, 0.1) == 2  # a little background costs nothing
    assert threads.free_threads(2, 0.8) == 1  # a busy neighbour: one thread, not a stalled team
    assert threads.free_threads(2, 5.0) == 1  # at least one
    assert threads.free_threads(16, 3.5) == 12


def test_cpu_use_counts_other_processes_busy_time_not_this_ones(tmp_path, monkeypatch):
    stat = tmp_path / "stat"
    tick = os.sysconf("SC_CLK_TCK")

    def write(busy_s: float, idle_s: float) -> None:  # user nice system idle iowait irq softirq steal
        stat.write_text(f"cpu  {int(busy_s * tick)} 0 0 {int(idle_s * tick)} 0 0 0 0 0 0\ncpu0 0\n")

    clock = iter([100.0, 101.0, 101.01, 102.01])
    own = iter([10.0, 10.5, 10.5, 10.5])  # this process: half a core in the first second
    # the fake clock and CPU times for this thread only: a thread an earlier test left running
    # (a bus client, a core-share loop) reads the real ones instead of taking this test's values
    import threading

    me, real_monotonic, real_times = threading.get_ident(), time.monotonic, os.times
    monkeypatch.setattr("time.monotonic", lambda: next(clock) if threading.get_ident() == me else real_monotonic())
    monkeypatch.setattr(os, "times", lambda: os.times_result((next(own), 0.0, 0.0, 0.0, 0.0))
                        if threading.get_ident() == me else real_times())
    write(1000.0, 5000.0)
    use = threads.CpuUse(str(stat))
    write(1001.7, 5000.3)  # 1.7 s busy in 1 s of wall time, 0.5 s of it ours
    assert abs(use.others() - 1.2) < 0.02
    write(1001.7, 5000.3)
    assert use.others() is None  # 10 ms: too short a window to say
    write(1002.7, 5001.3)  # 1 s busy in the next second, none of it ours
    assert abs(use.others() - 1.0) < 0.02
    assert threads.CpuUse(str(tmp_path / "absent")).others() is None


def fake_runnable(tmp_path, running: int, own_states: list[str]) -> tuple[str, str]:
    """A /proc/stat saying ``running`` threads are runnable, and a /proc/self/task with one
    thread per state in ``own_states`` (its name has a space and a parenthesis, as names may)."""
    stat = tmp_path / "stat"
    stat.write_text(f"cpu  1 0 0 1 0 0 0 0 0 0\nctxt 5\nprocs_running {running}\nprocs_blocked 0\n")
    tasks = tmp_path / "task"
    for i, state in enumerate(own_states):
        (tasks / str(100 + i)).mkdir(parents=True)
        (tasks / str(100 + i) / "stat").write_text(f"{100 + i} (kvasir (sched) 0) {state} 1 2 3\n")
    return str(stat), str(tasks)


def test_runnable_others_are_the_machines_runnable_threads_less_this_processes(tmp_path):
    stat, tasks = fake_runnable(tmp_path, running=3, own_states=["R", "S", "R", "S"])
    assert threads.runnable_others(stat, tasks) == 1  # two of the three are ours
    (tmp_path / "stat").write_text("cpu  1 0 0 1 0 0 0 0 0 0\nprocs_running 1\n")
    assert threads.runnable_others(stat, tasks) == 0  # never below zero (the counts are two looks)
    assert threads.runnable_others(str(tmp_path / "absent"), tasks) is None


def test_work_after_a_quiet_spell_takes_the_share_back_only_if_nobody_else_runs(monkeypatch):
    """A neighbour busy until the moment a server's request arrives left the last look at one
    thread; waking() gives the share back when no other thread is runnable now, and keeps it
    down while one is."""
    monkeypatch.delenv(threads.ENV_THREADS, raising=False)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    monkeypatch.setattr(threads, "compute_processes", lambda proc="/proc": 1)
    share = threads.CoreShare(period_s=3600, load_period_s=3600)  # no looks of its own during the test
    monkeypatch.setattr(threads, "_share", share)
    try:
        share.threads, share.others_busy = 1, 1.2  # what the last look saw: a busy neighbour
        monkeypatch.setattr(threads, "runnable_others", lambda: 1)
        threads.waking()
        assert share.threads == 1  # still busy: the share stays down
        monkeypatch.setattr(threads, "runnable_others", lambda: 0)
        threads.waking()
        assert share.threads == 2 and os.environ[threads.ENV_THREADS] == "2" and share.others_busy is None
        monkeypatch.setattr(threads, "runnable_others", lambda: None)
        share.threads = 1
        threads.waking()
        assert share.threads == 1  # no /proc to ask: the last look stands
    finally:
        share.stop()
