"""The benchmark CLI (python3 -m bench, run from the checkout) on CPU: argument parsing, FLOP counting, the timing loop,
failure handling, the report writers, and a tiny end-to-end run on toy shapes.

Timings themselves are meaningless here; what is checked is that every contender's failure is
recorded rather than raised, and that the files the GPU run relies on are written.
"""
from __future__ import annotations

import argparse
import json
import math

import pytest

import bench
from bench import attention, based, report, scale, timing
from bench import parse_int_list
from bench.__main__ import main, parse_args


# ---------------------------------------------------------------------------------------------
# Arguments.

def test_parse_int_list_accepts_k_suffix():
    assert parse_int_list("512,1k, 16K") == [512, 1024, 16384]


@pytest.mark.parametrize("bad", ["", "abc", "1k,x", "0", "-5"])
def test_parse_int_list_rejects_bad_values(bad):
    with pytest.raises(argparse.ArgumentTypeError):
        parse_int_list(bad)


def test_parse_args_defaults_and_options():
    args = parse_args([])
    assert (args.suite, args.causal, args.reps, args.fwd_only, args.tk_backend) == \
        ("all", "both", 10, False, "kernel")
    args = parse_args(["attention", "--d", "64,128", "--t", "2k", "--causal", "yes",
                       "--fwd-only", "--reps", "3", "--contenders", "tk,cudnn", "--quick"])
    assert args.suite == "attention" and args.d == [64, 128] and args.t == [2048]
    assert args.causal == "yes" and args.fwd_only and args.reps == 3 and args.quick
    assert args.contenders == ["tk", "cudnn"]
    assert parse_args(["--peers-only"]).list
    args = parse_args(["attention", "--sequential", "--settle", "0.5"])
    assert args.sequential and args.settle == 0.5 and parse_args([]).settle == 1.0


@pytest.mark.parametrize("argv", [["nonsense"], ["--reps", "0"], ["--causal", "maybe"],
                                  ["--settle", "-1"], ["--settle", "nan"]])
def test_parse_args_rejects_bad_input(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


# ---------------------------------------------------------------------------------------------
# Configurations and FLOPs.

def test_attention_grid_keeps_tokens_and_width_fixed():
    configs = attention.make_configs(attention.T_GRID, attention.D_GRID, (False, True),
                                     (False, True))
    assert len(configs) == 6 * 3 * 2 * 2
    for c in configs:
        assert c.batch * c.t == attention.TOKENS and c.heads * c.d == attention.MODEL_WIDTH


def test_attention_flops():
    config = attention.AttentionConfig(t=8, d=4, causal=False, backward=False, batch=3, heads=5)
    full_forward = 4 * 3 * 5 * 8 * 8 * 4
    assert attention.attention_flops(config) == full_forward
    causal_both = attention.AttentionConfig(t=8, d=4, causal=True, backward=True, batch=3,
                                            heads=5)
    assert attention.attention_flops(causal_both) == full_forward / 2 * 3.5


def test_based_decode_floor_bytes():
    # 273 features (1 + 16 + 256): kv [273, 64] and normaliser [273], fp32, read + write.
    assert based.decode_floor_bytes(64, 16) == (273 * 64 + 273) * 4 * 64 * 16 * 2


def test_input_sets_needed():
    assert timing.input_sets_needed(10 * 2**30) == 1        # far bigger than L2
    assert timing.input_sets_needed(2**20) == 3             # fits L2: rotate, capped at 3
    assert timing.input_sets_needed(timing.L2_BYTES) == 2


def test_sanitize_card_name():
    assert report.sanitize_card_name("NVIDIA H100 80GB HBM3") == "nvidia-h100-80gb-hbm3"
    assert report.sanitize_card_name(" ?? ") == "unknown"


# ---------------------------------------------------------------------------------------------
# The timing loop and failure handling, with a fake clock (no device involved).

class FakeClock:
    """start/stop read a counter that the fake runners' calls advance."""

    now = 0.0

    def start(self):
        return self.now

    def stop(self, token, last_output):
        return self.now - token

    def sync(self, last_output):
        pass


def fake_runner(seconds_per_call=1e-3, *, clock=None, log=None, name="", fail_after=None,
                n_sets=2, release=None):
    """A runner whose calls 'take' `seconds_per_call` on `clock` (shared by runners timed
    together: the device is one), appending (name, input set) to `log`, and raising once it
    has made `fail_after` calls."""
    clock = clock or FakeClock()
    log = [] if log is None else log

    def call(i):
        if fail_after is not None and sum(n == name for n, _ in log) >= fail_after:
            raise RuntimeError(f"{name} lost the device")
        log.append((name, i))
        clock.now += seconds_per_call
        return i
    return timing.Runner(call=call, n_sets=n_sets, clock=clock, release=release)


def test_measure_reports_per_call_time_and_rotates_inputs():
    log = []
    result = timing.measure(fake_runner(2e-3, log=log, n_sets=3), reps=4, min_rep_seconds=0.02)
    assert math.isclose(result.median_s, 2e-3)
    assert result.calls_per_rep == 10 and result.reps == 4
    assert {i for _, i in log} == {0, 1, 2}


def contender(name, prepare, unavailable=None):
    return bench.Contender(name=name, description=name, role=bench.PEER,
                           unavailable=lambda: unavailable, prepare=prepare)


def raiser(err):
    def prepare(config):
        raise err
    return prepare


def test_run_one_records_every_kind_of_failure_without_raising():
    cases = {
        "ok": (contender("ok", lambda c: fake_runner()), bench.OK),
        "unsup": (contender("unsup", raiser(bench.Unsupported("no D=512"))), bench.UNSUPPORTED),
        "skip": (contender("skip", raiser(bench.Skipped("too long"))), bench.SKIPPED),
        "boom": (contender("boom", raiser(RuntimeError("kaput\nline two"))), bench.ERROR),
        "absent": (contender("absent", raiser(AssertionError), unavailable="not installed"),
                   bench.UNAVAILABLE),
    }
    for name, (c, expected) in cases.items():
        outcome = bench.run_one(c, None, {"t": 1}, reps=2)
        assert outcome.status == expected, (name, outcome)
    boom = bench.run_one(cases["boom"][0], None, {}, reps=1)
    assert boom.reason == "RuntimeError: kaput line two"
    ok = bench.run_one(cases["ok"][0], None, {}, reps=3)
    assert math.isclose(ok.median_ms, 1.0) and ok.reps == 3


def test_run_one_reports_errors_raised_while_timing():
    c = contender("late", lambda cfg: fake_runner(fail_after=0))
    outcome = bench.run_one(c, None, {}, reps=2)
    assert outcome.status == bench.ERROR and "lost the device" in outcome.reason


def test_measure_interleaved_takes_samples_in_rotating_turns():
    clock, log = FakeClock(), []
    runners = [fake_runner(t, clock=clock, log=log, name=name)
               for name, t in (("a", 1e-3), ("b", 4e-3), ("c", 2e-3))]
    results = timing.measure_interleaved(runners, reps=3, warmup=2, min_rep_seconds=0.004)
    assert [r.reps for r in results] == [3, 3, 3]
    for result, seconds in zip(results, (1e-3, 4e-3, 2e-3)):
        assert math.isclose(result.median_s, seconds) and math.isclose(result.min_s, seconds)
    assert [r.calls_per_rep for r in results] == [4, 1, 2]
    # Warm-up (2 calls + 1 timing call each) in order, then one sample of each per round,
    # round r starting from runner r mod 3.
    timed = [name for name, _ in log[9:]]
    samples, i = [], 0
    while i < len(timed):
        name = timed[i]
        count = {"a": 4, "b": 1, "c": 2}[name]
        assert timed[i:i + count] == [name] * count
        samples.append(name)
        i += count
    assert samples == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_measure_interleaved_keeps_timing_the_others_when_one_fails():
    clock, log = FakeClock(), []
    runners = [fake_runner(clock=clock, log=log, name="ok"),
               fake_runner(clock=clock, log=log, name="flaky", fail_after=5),
               fake_runner(clock=clock, log=log, name="dead", fail_after=0)]
    ok, flaky, dead = timing.measure_interleaved(runners, reps=4, warmup=1, min_rep_seconds=0.002)
    assert ok.reps == 4 and math.isclose(ok.median_s, 1e-3)
    assert isinstance(flaky, RuntimeError) and "flaky" in str(flaky)
    assert isinstance(dead, RuntimeError)
    with pytest.raises(ValueError):
        timing.measure_interleaved(runners, reps=0)


def test_measure_interleaved_settles_before_recording():
    clock, log = FakeClock(), []
    runners = [fake_runner(clock=clock, log=log, name=name) for name in ("a", "b")]
    timing.measure_interleaved(runners, reps=2, warmup=1, min_rep_seconds=0.002)
    unsettled = len(log)
    log.clear()
    results = timing.measure_interleaved(runners, reps=2, warmup=1, min_rep_seconds=0.002,
                                         settle_seconds=0.05)
    assert len(log) > unsettled and len(log) % 2 == 0  # whole rounds of both ran first
    assert [r.reps for r in results] == [2, 2] and math.isclose(results[0].median_s, 1e-3)


def test_run_grid_interleaved_records_failures_in_contender_order():
    clock, log = FakeClock(), []
    released = []

    def prepare_ok(name, seconds):
        return lambda config: fake_runner(seconds, clock=clock, log=log, name=name,
                                          release=lambda: released.append(name))

    contenders = [contender("fast", prepare_ok("fast", 1e-3)),
                  contender("unsup", raiser(bench.Unsupported("no D=512"))),
                  contender("slow", prepare_ok("slow", 3e-3)),
                  contender("absent", raiser(AssertionError), unavailable="not installed")]
    seen = []
    outcomes = bench.run_grid([1, 2], contenders, reps=3, to_dict=lambda c: {"t": c},
                              add_metrics=lambda c, o: o.metrics.update(ms=o.median_ms),
                              on_outcome=lambda c, o: seen.append((c, o.contender)),
                              interleave=True)
    assert [(o.config["t"], o.contender, o.status) for o in outcomes] == [
        (t, name, status) for t in (1, 2) for name, status in
        (("fast", bench.OK), ("unsup", bench.UNSUPPORTED), ("slow", bench.OK),
         ("absent", bench.UNAVAILABLE))]
    assert math.isclose(outcomes[0].metrics["ms"], 1.0) and math.isclose(outcomes[2].median_ms, 3.0)
    assert seen == [(o.config["t"], o.contender) for o in outcomes]
    assert released == ["fast", "slow", "fast", "slow"]  # each configuration's runners let go


# ---------------------------------------------------------------------------------------------
# Reports.

def outcome_dict(contender_name, role, t, status="ok", tflops=None, reason=""):
    return {"config": {"pass": "fwd", "t": t}, "contender": contender_name, "role": role,
            "status": status, "reason": reason, "median_ms": 1.0,
            "metrics": {} if tflops is None else {"tflops": tflops}}


SPEC = report.TableSpec(group_field="pass", key_fields=("t",),
                        metric=lambda o: o["metrics"]["tflops"], metric_name="TFLOP/s",
                        higher_is_better=True)


def test_results_table_ratio_and_notes():
    outcomes = [
        outcome_dict("tk", bench.OURS, 1024, tflops=600.0),
        outcome_dict("cudnn", bench.PEER, 1024, tflops=400.0),
        outcome_dict("fa3", bench.PEER, 1024, tflops=500.0),
        outcome_dict("tk", bench.OURS, 512, status="unsupported", reason="T too short"),
        outcome_dict("cudnn", bench.PEER, 512, tflops=300.0),
        outcome_dict("fa3", bench.PEER, 512, status="error", reason="Boom"),
    ]
    text = report.results_tables(outcomes, ["tk", "cudnn", "fa3"], SPEC)
    lines = text.splitlines()
    row_512 = next(line for line in lines if line.startswith("| 512"))
    row_1024 = next(line for line in lines if line.startswith("| 1024"))
    assert lines.index(row_512) < lines.index(row_1024)  # numeric order
    assert "1.20x vs fa3" in row_1024                    # 600 / best peer 500
    assert "unsup. [1]" in row_512 and "error [2]" in row_512
    assert row_512.split("|")[-2].strip() == "-"  # no ratio without tk
    assert "[1] tk unsupported: T too short" in text and "[2] fa3 error: Boom" in text


def test_speed_ratio_for_times():
    assert report.speed_ratio(2.0, 3.0, higher_is_better=False) == 1.5  # tk takes 2 ms, peer 3
    assert report.speed_ratio(None, 3.0, higher_is_better=True) is None


def test_merge_keeps_old_points_not_measured_again():
    old = [outcome_dict("tk", bench.OURS, 512, tflops=1.0),
           outcome_dict("tk", bench.OURS, 1024, tflops=2.0)]
    new = [outcome_dict("tk", bench.OURS, 1024, tflops=3.0)]
    merged = report.merge_outcomes(old, new)
    assert sorted((o["config"]["t"], o["metrics"]["tflops"]) for o in merged) == \
        [(512, 1.0), (1024, 3.0)]


def test_write_plot(tmp_path):
    pytest.importorskip("matplotlib")
    outcomes = [outcome_dict("tk", bench.OURS, t, tflops=t / 10) for t in (512, 1024, 2048)]
    path = report.write_plot(str(tmp_path / "p.png"), outcomes, panel_fields=("pass",),
                             x_field="t", metric=lambda o: o["metrics"]["tflops"],
                             metric_name="TFLOP/s", contender_names=["tk"], title="t")
    assert path and (tmp_path / "p.png").stat().st_size > 1000


# ---------------------------------------------------------------------------------------------
# End to end on toy shapes (CPU): peers that cannot run (cuDNN, FA3, fla) must not stop it.

def test_list_and_dry_run(capsys):
    assert main(["--list"]) == 0
    listing = capsys.readouterr().out
    for name in ("tk", "cudnn", "fa3", "xla", "tk_reference", "fla_fused_chunk", "fla_parallel"):
        assert f"  {name} " in listing
    assert main(["all", "--tiny", "--dry-run"]) == 0
    assert "decode step" in capsys.readouterr().out


def test_tiny_attention_run_writes_results(tmp_path, capsys):
    argv = ["attention", "--tiny", "--fwd-only", "--t", "64", "--reps", "1",
            "--tk-backend", "reference", "--out", str(tmp_path), "--card-name", "Test Card",
            "--no-plot"]
    assert main(argv) == 0
    document = json.loads((tmp_path / "attention-test-card.json").read_text())
    statuses = {(o["contender"], o["config"]["causal"]): o for o in document["results"]}
    assert len(statuses) == len(attention.contenders()) * 2  # every contender x (full, causal)
    for causal in (False, True):
        for name in ("tk_reference", "xla"):
            o = statuses[(name, causal)]
            assert o["status"] == "ok", o
            assert o["metrics"]["tflops"] > 0
    markdown = (tmp_path / "attention-test-card.md").read_text()
    assert "tk_reference (TFLOP/s)" in markdown and "| 32 | causal | 64" in markdown
    assert "timing: contenders in turns, 1 samples each after 1.0 s" in markdown
    assert "attention-test-card.md" in capsys.readouterr().out


def test_tiny_based_run_with_decode(tmp_path):
    argv = ["based", "--tiny", "--fwd-only", "--t", "64", "--reps", "1", "--out",
            str(tmp_path), "--card-name", "cpu", "--no-plot"]
    assert main(argv) == 0
    document = json.loads((tmp_path / "based-cpu.json").read_text())
    by_name = {o["contender"]: o for o in document["results"]}
    assert by_name["tk_reference"]["status"] == "ok", by_name["tk_reference"]
    # On CPU the kernel cannot run: it must be reported, not raised.
    assert by_name["tk"]["status"] in ("unsupported", "ok"), by_name["tk"]
    decode = document["decode"]
    assert decode["status"] == "ok", decode
    assert decode["floor_bytes"] == based.decode_floor_bytes(2, 2)
    assert "decode step" in (tmp_path / "based-cpu.md").read_text()


# ---------------------------------------------------------------------------------------------
# The scale suite (multi-GPU): its arithmetic and report, from made-up measurements.

def test_scale_suite_ring_pieces_estimate_and_report(capsys):
    t, n = 64, 4
    blocks = scale.ring_step_blocks(t, n)
    assert [(b.count, b.tq, b.tk, b.causal) for b in blocks] == [(1, 16, 16, True),
                                                                  (3, 16, 8, False)]
    # n devices together cover the causal half of the T x T (query, key) pairs.
    assert n * sum(b.count * b.tq * b.tk * (0.5 if b.causal else 1) for b in blocks) == t * t / 2
    assert scale.ring_transfers(n) == (6, 3)
    assert scale.hidden_comm(ring_ms=10.0, compute_ms=9.0, comm_ms=4.0) == \
        {"overhead_ms": 1.0, "hidden_ms": 3.0, "hidden_fraction": 0.75}
    assert scale.hidden_comm(10.0, 11.0, 4.0)["hidden_fraction"] == 1.0  # no overhead at all
    assert scale.hidden_comm(10.0, 2.0, 4.0)["hidden_fraction"] == 0.0   # overhead > comm
    assert scale.device_counts(1) == [1] and scale.device_counts(2) == [1, 2]
    assert scale.collectives("x = all-reduce-start(y) z = collective-permute-done(w)") == \
        ["all-reduce", "collective-permute"]

    def result(part, name, devices, ms=None, status="ok", reason="", **fields):
        config = {"part": part, "name": name, "devices": devices, **fields}
        return {"config": config, "contender": name, "status": status, "reason": reason,
                "median_ms": ms, "metrics": {"collectives": []}}

    ring_t, lm_batch = 128, scale.TINY.lm_batch
    assert scale.lm_batches(lm_batch, 1) == [lm_batch]
    assert scale.lm_batches(lm_batch, 2) == [lm_batch, 2 * lm_batch]
    results = [
        result(scale.ATTENTION, scale.SHARDED_ATTENTION, 1, 10.0),
        result(scale.ATTENTION, scale.SHARDED_ATTENTION, 2, 5.0),
        result(scale.LM, scale.LM_STEP, 1, 10.0, batch=lm_batch),
        result(scale.LM, scale.LM_STEP, 2, 6.0, batch=lm_batch),            # strong scaling
        result(scale.LM, scale.LM_STEP, 2, status="error", batch=2 * lm_batch,  # weak
               reason="XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory"),
        result(scale.RING, scale.FLASH_WHOLE, 1, 8.0, t=ring_t),
        result(scale.RING, scale.RING_ATTENTION, 2, 5.0, t=ring_t),
        result(scale.RING, scale.RING_ATTENTION_LHS, 2, 4.5, t=ring_t),
        result(scale.RING, scale.STEP_DIAGONAL, 1, 1.0, t=ring_t),
        result(scale.RING, scale.STEP_OFF_DIAGONAL, 1, 3.0, t=ring_t),  # x (2-1): sum 4 ms
        result(scale.RING, scale.SEND_KV, 2, 0.5, t=ring_t),            # x 2(2-1)
        result(scale.RING, scale.SEND_DKV, 2, 1.0, t=ring_t),           # x (2-1): comm 2 ms
        result(scale.SEQUENCE, scale.SEQUENCE_SHARDED, 2, 4.0, t=ring_t),
    ]
    text = scale.scale_report(results, 2, scale.TINY, (ring_t,))
    lines = text.splitlines()
    attention_2 = next(line for line in lines if line.startswith("| 2 ") and "none" in line)
    assert "| 5.00 " in attention_2 and "2.00x" in attention_2 and "100%" in attention_2
    lm_section = text.split("### 2.")[1].split("### 3.")[0]
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in lm_section.splitlines()
            if line.startswith("|")]
    lm_strong = next(r for r in rows if r[:3] == ["2", str(lm_batch), str(lm_batch // 2)])
    assert lm_strong[3] == "6.00" and lm_strong[6] == "1.67x"  # (8 seq / 6 ms) / (8 seq / 10 ms)
    lm_weak = next(r for r in rows if "OOM [1]" in r)
    assert lm_weak[:3] == ["2", str(2 * lm_batch), str(lm_batch)]
    assert "RESOURCE_EXHAUSTED" in text.split("Notes:")[1]
    ring_section = text.split("### 3.")[1].split("### 4.")[0]
    ring_row = next(line for line in ring_section.splitlines()
                    if line.startswith(f"| {ring_t} "))
    # speedup 8/5; sum of steps 1 + 3 = 4; overhead 5 - 4 = 1; comm 2*0.5 + 1*1 = 2;
    # hidden (2 - 1) / 2 = 50%; with the latency-hiding scheduler 4.5 ms: (2 - 0.5) / 2 = 75%.
    cells = [c.strip() for c in ring_row.strip("|").split("|")]
    assert cells[2:] == ["5.00", "1.60x", "1.00", "50%", "4.50", "1.78x", "0.500", "75%",
                         "4.00", "2.00"], cells
    sequence_row = next(line for line in text.split("### 4.")[1].splitlines()
                        if line.startswith(f"| {ring_t} "))
    cells = [c.strip() for c in sequence_row.strip("|").split("|")]
    assert cells[2:5] == ["8.00", "4.00", "2.00x"], cells
    only_ring = scale.scale_report(results, 2, scale.TINY, (ring_t,), (scale.RING,))
    assert "### 3." in only_ring and "### 1." not in only_ring and "### 4." not in only_ring

    assert main(["scale", "--tiny", "--dry-run"]) == 0
    assert "ring_attention" in capsys.readouterr().out


def test_compiled_jax_runner_forward_and_backward(rng):
    """The one step builder both suites use: forward returns o; forward+backward returns o
    and the VJP of o against the set's cotangent (checked against an explicit gradient)."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    def attend(q, k, v):
        return jnp.tanh(q * k) + v

    sets = [tuple(jnp.asarray(rng.standard_normal((3, 4)), jnp.float32) for _ in range(4))]
    q, k, v, cot = sets[0]
    forward = timing.compiled_jax_runner(attend, [s[:3] for s in sets], backward=False)
    np.testing.assert_allclose(forward.call(0), attend(q, k, v), rtol=1e-6)
    both = timing.compiled_jax_runner(attend, sets, backward=True)
    o, (dq, dk, dv) = both.call(0)
    expected = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * cot), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(o, attend(q, k, v), rtol=1e-6)
    for got, want in zip((dq, dk, dv), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert both.n_sets == 1
