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
    np.testing.assert_allclose(forward.call(0), attend(q, k, v), rtol=1e-6, atol=1e-6)
    both = timing.compiled_jax_runner(attend, sets, backward=True)
    o, (dq, dk, dv) = both.call(0)
    expected = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v) * cot), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(o, attend(q, k, v), rtol=1e-6, atol=1e-6)
    for got, want in zip((dq, dk, dv), expected):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert both.n_sets == 1


# ---------------------------------------------------------------------------------------------
# The gqa, packed and decode suites: their grids, arithmetic and reports on CPU.

from bench import decode, gqa, packed  # noqa: E402


def test_new_suites_parse_with_frugal_defaults():
    for suite, reps, settle in (("gqa", 5, 0.5), ("packed", 5, 0.5), ("decode", 5, 0.2),
                                ("attention", 10, 1.0)):
        args = parse_args([suite])
        assert (args.suite, args.reps, args.settle) == (suite, reps, settle)
    args = parse_args(["gqa", "--ratios", "1,4,MQA", "--full", "--reps", "3", "--settle", "0"])
    assert args.ratios == [1, 4, "mqa"] and args.full and args.reps == 3 and args.settle == 0
    args = parse_args(["decode", "--heads", "32/8,64/8", "--batch", "1,8", "--cache", "4k,128k",
                       "--q-tokens", "1,4", "--page-sizes", "16", "--fa3-splits", "1,4",
                       "--max-cache-gb", "10"])
    assert args.heads == [(32, 8), (64, 8)] and args.batch == [1, 8]
    assert args.cache == [4096, 131072] and args.q_tokens == [1, 4]
    assert args.page_sizes == [16] and args.fa3_splits == [1, 4] and args.max_cache_gb == 10
    args = parse_args(["packed", "--layouts", "mean2k,long+short", "--rows", "2", "--heads",
                       "8/2"])
    assert args.layouts == ["mean2k", "long+short"] and args.rows == 2
    assert args.heads == [(8, 2)]


@pytest.mark.parametrize("argv", [["gqa", "--ratios", "0"], ["gqa", "--ratios", "two"],
                                  ["decode", "--heads", "32/5"], ["decode", "--heads", "32"],
                                  ["packed", "--layouts", "mean1k"], ["packed", "--rows", "0"],
                                  ["packed", "--heads", "16/4,8/2"],
                                  ["decode", "--max-cache-gb", "0"]])
def test_new_suites_reject_bad_arguments(argv):
    with pytest.raises(SystemExit):
        parse_args(argv)


def test_gqa_grid_heads_ratios_and_flops():
    configs, notes = gqa.make_configs(gqa.T_GRID, gqa.D_GRID, gqa.RATIOS, (False, True),
                                      (False, True))
    assert not notes
    # Hq * D = 4096; every ratio at every D, 16 and MQA being one point at D = 256.
    assert len(configs) == 2 * 2 * len(gqa.T_GRID) * (6 + 6 + 5)
    for c in configs:
        assert c.hq * c.d == gqa.QUERY_WIDTH and c.batch * c.t == gqa.TOKENS
        assert c.hq == c.hkv * c.q_per_kv
    groups = {d: sorted({c.q_per_kv for c in configs if c.d == d}) for d in gqa.D_GRID}
    assert groups == {64: [1, 2, 4, 8, 16, 64], 128: [1, 2, 4, 8, 16, 32],
                      256: [1, 2, 4, 8, 16]}
    full, _ = gqa.make_configs(gqa.FULL_T, gqa.D_GRID, gqa.RATIOS, (True,), (True,))
    assert sorted({c.t for c in full}) == [1024, 2048, 4096, 8192, 16384]
    odd, notes = gqa.make_configs((3000,), (96,), (3,), (True,), (True,))
    assert odd == [] and len(notes) == 2  # T and D that do not divide are named
    c = gqa.GqaConfig(d=4, causal=True, t=8, batch=3, q_per_kv=5, hq=5, hkv=1, backward=True)
    assert attention.attention_flops(c) == 4 * 3 * 5 * 8 * 8 * 4 / 2 * 3.5


def test_packed_layouts_are_fixed_and_fill_the_rows():
    for name in packed.LAYOUTS:
        rows = packed.document_lengths(name, 4, packed.ROW_TOKENS)
        packed.document_lengths.cache_clear()
        assert packed.document_lengths(name, 4, packed.ROW_TOKENS) == rows  # fixed seeds
        assert len(rows) == 4 and all(sum(r) == packed.ROW_TOKENS for r in rows)
        assert all(n >= 1 for r in rows for n in r)
        assert len({r for r in rows}) == 4  # rows differ
    mean = lambda rows: sum(map(sum, rows)) / sum(map(len, rows))  # noqa: E731
    assert 350 < mean(packed.document_lengths("mean512", 4, packed.ROW_TOKENS)) < 700
    assert 1200 < mean(packed.document_lengths("mean2k", 4, packed.ROW_TOKENS)) < 3000
    for row in packed.document_lengths("long+short", 4, packed.ROW_TOKENS):
        assert max(row) == 12288 and len(row) > 10


def test_packed_ids_offsets_and_exact_flops():
    import numpy as np

    config = packed.make_configs(["long+short"], [8], [True], rows=2, row_tokens=64,
                                 heads=(4, 2))[0]
    lengths = packed.all_lengths(config)
    assert config.docs == len(lengths) and sum(lengths) == 128
    ids = packed.segment_ids(config)
    cu = packed.cu_seqlens(config)
    assert ids.shape == (2, 64) and ids.dtype == np.int32 and cu.dtype == np.int32
    assert list(np.diff(cu)) == lengths and cu[-1] == 128
    # FLOPs: the (query, key) pairs a causal mask within equal ids keeps, counted directly.
    positions = np.arange(64)
    pairs = sum(int(((ids[r][:, None] == ids[r][None, :]) &
                     (positions[:, None] >= positions[None, :])).sum()) for r in range(2))
    assert packed.packed_flops(config) == 4 * 4 * 8 * pairs * 3.5


def test_decode_grid_cells_and_call_sizes():
    configs, notes = decode.make_configs(decode.BATCHES, decode.CACHES, decode.HEADS,
                                         decode.FULL_D, decode.FULL_Q_TOKENS)
    # B=64, S=128k with 32 K/V heads is 64 or 128 GiB: left out at D 64 and 128, 1 and 4 tokens.
    assert len(configs) == 3 * 3 * 4 * 2 * 2 - 4 and len(notes) == 4
    assert all("B=64 S=131072 Hq/Hkv=32/32" in note for note in notes)
    default, _ = decode.make_configs(decode.BATCHES, decode.CACHES, decode.HEADS,
                                     decode.D_GRID, decode.Q_TOKENS)
    assert len(default) == 35
    for c in configs:
        n = c.kv_bytes
        assert n == 2 * c.batch * c.cache * c.hkv * c.d * 2 and n <= 40 * 2**30
        assert c.steps == decode.MAX_STEPS or c.steps * n >= decode.TARGET_CALL_BYTES
        assert 1 <= c.sets <= c.steps
        assert c.sets == c.steps or c.sets * n >= 2 * timing.L2_BYTES
    assert decode.steps_and_sets(2**30) == (1, 1)
    assert decode.steps_and_sets(64 * 2**20) == (8, 2)  # >= 512 MiB a call, 2 copies cover 2x L2
    assert decode.steps_and_sets(2**20) == (16, 16)
    quick, _ = decode.make_configs(decode.BATCHES, decode.CACHES, decode.HEADS, decode.D_GRID,
                                   decode.Q_TOKENS, cells=decode.QUICK_CELLS)
    assert len(quick) == len(decode.QUICK_CELLS)


def test_decode_inputs_are_random_and_pages_a_permutation():
    import jax.numpy as jnp
    import numpy as np

    x = np.asarray(decode.pseudo_random((3, 50, 2, 8), jnp.bfloat16, 0), np.float32)
    y = np.asarray(decode.pseudo_random((3, 50, 2, 8), jnp.bfloat16, 1), np.float32)
    assert x.min() >= -1 and x.max() <= 1 and 0.4 < x.std() < 0.8  # [-1, 1) before bf16 rounding
    assert len(np.unique(x)) > 100 and not np.array_equal(x, y)
    config = decode.make_configs((2,), (64,), ((4, 2),), (8,), (1,))[0][0]
    table = np.asarray(decode.page_table(config, 16))
    assert table.shape == (2, 4) and sorted(table.ravel()) == list(range(8))


def test_fastest_setting_picks_the_fastest_and_skips_failures():
    def build(seconds):
        def make():
            if seconds is None:
                raise ValueError("num_splits not supported")
            return timing.Runner(call=lambda i: None, n_sets=1, clock=FakeClock(),
                                 info={"seconds": seconds})
        return make

    runner = decode.fastest_setting({1: build(3e-3), 2: build(1e-3), 16: build(None)},
                                    "num_splits", per_call=2,
                                    time_runner=lambda r: r.info["seconds"])
    assert runner.info["num_splits"] == 2
    assert runner.info["num_splits_tried"].startswith("1: 1500.0 us, 2: 500.0 us, 16: error")
    with pytest.raises(RuntimeError, match="every num_splits failed"):
        decode.fastest_setting({16: build(None)}, "num_splits", time_runner=lambda r: 1.0)


def test_runner_info_reaches_the_outcome():
    c = contender("picky", lambda cfg: timing.Runner(call=lambda i: None, n_sets=1,
                                                     clock=FakeClock(), info={"num_splits": 4}))
    outcome = bench.run_one(c, None, {}, reps=1)
    assert outcome.status == bench.OK and outcome.metrics == {"num_splits": 4}


def test_compiled_jax_runner_passes_constants_undifferentiated(rng):
    import jax
    import jax.numpy as jnp
    import numpy as np

    def attend(q, k, v, ids):
        return jnp.where(ids[:, None] > 0, q * k, v)

    ids = jnp.asarray([0, 1, 1], jnp.int32)
    q, k, v, cot = (jnp.asarray(rng.standard_normal((3, 2)), jnp.float32) for _ in range(4))
    both = timing.compiled_jax_runner(attend, [(q, k, v, cot)], backward=True, constants=(ids,))
    o, grads = both.call(0)
    expected = jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, ids) * cot), (0, 1, 2))(q, k, v)
    np.testing.assert_allclose(o, attend(q, k, v, ids), rtol=1e-6, atol=1e-6)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    forward = timing.compiled_jax_runner(attend, [(q, k, v)], backward=False, constants=(ids,))
    np.testing.assert_allclose(forward.call(0), attend(q, k, v, ids), rtol=1e-6, atol=1e-6)


def test_extra_columns_and_ratio_helpers():
    def o(name, role, value, status="ok"):
        return {"config": {"pass": "fwd", "t": 1}, "contender": name, "role": role,
                "status": status, "reason": "", "median_ms": 1.0,
                "metrics": {"tflops": value} if value else {}}

    row = {"tk": o("tk", bench.OURS, 300.0), "fa3_varlen": o("fa3_varlen", bench.PEER, 200.0),
           "tk_per_doc": o("tk_per_doc", bench.BASELINE, 400.0),
           "cudnn": o("cudnn", bench.PEER, None, status="error")}
    metric = lambda x: x["metrics"]["tflops"]  # noqa: E731
    assert report.best_peer(row, metric) == (200.0, "fa3_varlen")
    assert report.metric_of(row, "cudnn", metric) is None
    assert report.ratio_cell(300.0, 400.0) == "0.75x" and report.ratio_cell(None, 1.0) == "-"
    spec = report.TableSpec(group_field="pass", key_fields=("t",), metric=metric,
                            metric_name="TFLOP/s", higher_is_better=True,
                            extra_columns=(("tk / tk_per_doc", lambda r: report.ratio_cell(
                                report.metric_of(r, "tk", metric),
                                report.metric_of(r, "tk_per_doc", metric))),),
                            footer="Targets: see the issue.")
    text = report.results_tables(list(row.values()), ["tk", "fa3_varlen", "tk_per_doc"], spec)
    line = next(line for line in text.splitlines() if line.startswith("| 1 "))
    assert "1.50x vs fa3_varlen" in line and line.rstrip(" |").endswith("0.75x")
    assert "tk / tk_per_doc" in text and "Targets: see the issue." in text


def test_new_suite_plots(tmp_path):
    pytest.importorskip("matplotlib")

    def o(name, role, config, **metrics):
        return {"config": config, "contender": name, "role": role, "status": "ok",
                "reason": "", "median_ms": 1.0, "metrics": metrics}

    outcomes = []
    for d in (64, 128):
        for group in (1, 4, 4096 // d):
            for causal in (False, True):
                for p in ("fwd", "fwd+bwd"):
                    config = {"d": d, "t": 4096, "causal": causal, "pass": p, "q_per_kv": group}
                    outcomes += [o("tk", bench.OURS, config, tflops=500.0 - group),
                                 o("cudnn", bench.PEER, config, tflops=450.0),
                                 o("fa3", bench.PEER, config, tflops=480.0)]
    ratios = gqa.tk_over_best(outcomes)
    assert len(ratios) == 2 * 3 * 4 and math.isclose(ratios[(64, 4096, True, "fwd", 1)],
                                                     499 / 480)
    assert gqa.write_ratio_plot(str(tmp_path / "g.png"), outcomes, [], "gqa")
    decode_outcomes = []
    for kv_mb, batch in ((4.0, 1), (256.0, 8)):
        config = {"d": 128, "hq": 32, "hkv": 8, "batch": batch, "cache": 4096, "q_tokens": 1,
                  "kv_mb": kv_mb, "steps": 1, "sets": 1, "pass": "fwd"}
        decode_outcomes += [o("tk", bench.OURS, config, tb_per_s=3.0, of_copy=0.9),
                            o("tk_flash", bench.BASELINE, config, tb_per_s=2.0, of_copy=0.6),
                            o("cudnn", bench.PEER, config, tb_per_s=2.8, of_copy=0.85)]
    assert decode.write_plot(str(tmp_path / "d.png"), decode_outcomes,
                             ["tk", "tk_flash", "cudnn"], "decode")
    packed_outcomes = [o(name, role, {"layout": layout, "d": 128, "pass": "fwd"}, tflops=v)
                       for layout in packed.LAYOUTS
                       for name, role, v in (("tk", bench.OURS, 400.0),
                                             ("fa3_varlen", bench.PEER, 300.0))]
    assert packed.write_bar_plot(str(tmp_path / "p.png"), packed_outcomes,
                                 ["tk", "fa3_varlen"], "packed")
    for name in ("g", "d", "p"):
        assert (tmp_path / f"{name}.png").stat().st_size > 1000


def test_new_suites_dry_run(capsys):
    assert main(["gqa", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "gqa: 68 configurations x 3 contenders (tk, cudnn, fa3)" in out
    assert "expected on one H100: about" in out and "Hq = 64 at D=64, 32 at D=128" in out
    assert main(["gqa", "--quick", "--dry-run"]) == 0
    assert "gqa: 6 configurations" in capsys.readouterr().out
    assert main(["packed", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "packed: 12 configurations x 3 contenders (tk, fa3_varlen, tk_per_doc)" in out
    assert "layout long+short: one document of 12288 tokens" in out
    assert main(["decode", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "decode: 35 configurations x 11 contenders" in out and "left out B=64" in out
    assert main(["decode", "--full", "--dry-run", "--contenders", "tk,cudnn,fa3"]) == 0
    assert "decode: 140 configurations x 3 contenders" in capsys.readouterr().out
    assert main(["decode", "--dry-run", "--contenders", "nonsense"]) == 2


def test_tiny_new_suites_record_every_contender(tmp_path):
    """Toy shapes on CPU: the reference backend runs; peers and APIs that are absent here are
    recorded (not raised) and the run goes on."""
    common = ["--tiny", "--reps", "1", "--settle", "0", "--tk-backend", "reference", "--out",
              str(tmp_path), "--card-name", "cpu", "--no-plot", "--fwd-only"]
    assert main(["gqa", "--ratios", "1,mqa", "--causal", "yes"] + common) == 0
    assert main(["packed", "--layouts", "mean2k"] + common) == 0
    assert main(["decode", "--batch", "1", "--cache", "64", "--heads", "4/1"] + common) == 0
    for suite, contenders, ran in (("gqa", gqa.contenders("reference"), ["tk_reference"]),
                                   ("packed", packed.contenders("reference"),
                                    ["tk_per_doc_reference"]),
                                   ("decode", decode.contenders("reference", (16,)),
                                    ["tk_flash_reference"])):
        document = json.loads((tmp_path / f"{suite}-cpu.json").read_text())
        by_name = {}
        for o in document["results"]:
            by_name.setdefault(o["contender"], []).append(o)
        assert set(by_name) == {c.name for c in contenders}, suite
        for name in ran:
            assert all(o["status"] == "ok" for o in by_name[name]), by_name[name]
        assert (tmp_path / f"{suite}-cpu.md").exists()
    decode_doc = json.loads((tmp_path / "decode-cpu.json").read_text())
    assert decode_doc["reference"]["bytes_per_s"] > 0
    flash = next(o for o in decode_doc["results"] if o["contender"] == "tk_flash_reference")
    assert flash["metrics"]["tb_per_s"] > 0 and flash["metrics"]["of_copy"] > 0
    assert "device copy rate" in (tmp_path / "decode-cpu.md").read_text()
    packed_doc = json.loads((tmp_path / "packed-cpu.json").read_text())
    segments = next(o for o in packed_doc["results"] if o["contender"] == "tk_reference")
    assert segments["status"] in ("ok", "unavailable"), segments  # until segment ids land
