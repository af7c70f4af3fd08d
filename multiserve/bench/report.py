"""The human-readable part of `multiserve bench` (pure formatting; the JSON line is the
contract, this is for people).

Owns: one row per run (tok/s, wall, TTFT and ITL percentiles), the ours-vs-peer table
(same prompts, same run: each figure side by side with the ratio ours / peer, and how
far the greedy outputs agree; sampled outputs are not compared), the step-time breakdown
table (breakdown.py), and the fleet table (4 engines, one client each, vs one engine
with the same 4 requests).
"""

from __future__ import annotations

import math
from typing import Any

MS = 1000.0
HEADER = (f"{'':<22}{'tok/s':>9}{'wall s':>9}{'TTFT p50':>10}{'TTFT p99':>10}"
          f"{'ITL p50':>9}{'ITL p99':>9}   (latencies in ms)")


def _num(value: Any, scale: float, width: int, digits: int) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f"{'-':>{width}}"
    return f"{float(value) * scale:>{width}.{digits}f}"


def run_row(name: str, r: dict[str, Any]) -> str:
    """One line of figures for a run (ours or a peer's); '-' where a figure is unknown."""
    return (f"{name:<22}{_num(r['tokens_per_s'], 1, 9, 1)}{_num(r['wall_s'], 1, 9, 2)}"
            f"{_num(r['ttft_p50_s'], MS, 10, 0)}{_num(r['ttft_p99_s'], MS, 10, 0)}"
            f"{_num(r['itl_p50_s'], MS, 9, 1)}{_num(r['itl_p99_s'], MS, 9, 1)}")


def ratio(a: Any, b: Any) -> float | None:
    """a / b, or None when either is unknown or b is 0."""
    try:
        x, y = float(a), float(b)
    except (TypeError, ValueError):
        return None
    if math.isnan(x) or math.isnan(y) or y == 0:
        return None
    return x / y


def sampling_label(res: dict[str, Any]) -> str:
    """How the run sampled: greedy, or the temperature and the per-request seeds."""
    t = float(res.get("temperature") or 0.0)
    if t <= 0:
        return "greedy"
    seed = res.get("seed", 0)
    seeds = f"seed {seed}" if res.get("num_prompts") == 1 else f"request i seeded {seed} + i"
    return f"sampled (temperature {t:g}, {seeds})"


def comparison_table(ours: dict[str, Any], peer: dict[str, Any], peer_name: str,
                     agreement: dict[str, float] | None, num_prompts: int, output_len: int,
                     note: str | None = None) -> list[str]:
    """Ours vs a peer, figure by figure, with ours / peer (tok/s: higher is better;
    latencies: lower is better); then how far the outputs agree, or `note` (why that
    is not compared) when `agreement` is None."""
    rows = [("tokens/s", "tokens_per_s", 1.0, 1),
            ("TTFT p50 ms", "ttft_p50_s", MS, 0), ("TTFT p99 ms", "ttft_p99_s", MS, 0),
            ("ITL p50 ms", "itl_p50_s", MS, 1), ("ITL p99 ms", "itl_p99_s", MS, 1),
            ("wall s", "wall_s", 1.0, 2)]
    out = [f"{'ours vs ' + peer_name + ' (same prompts, same run)':<40}"
           f"{'ours':>10}{peer_name:>10}{'ours/peer':>11}"]
    for label, key, scale, digits in rows:
        r = ratio(ours.get(key), peer.get(key))
        out.append(f"{label:<40}{_num(ours.get(key), scale, 10, digits)}"
                   f"{_num(peer.get(key), scale, 10, digits)}"
                   f"{'-' if r is None else f'{r:.2f}x':>11}")
    out.append("(ours/peer: above 1 is better for tokens/s, below 1 for times)")
    if agreement is None:
        out.append(f"outputs not compared: {note or 'no agreement figures'}")
        return out
    out.append(f"greedy outputs identical: {agreement['identical_fraction']:.0%} of "
               f"{num_prompts}; mean common prefix {agreement['mean_common_prefix']:.1f} "
               f"of {output_len} tokens")
    return out


LOAD_HEADER = (f"{'':<22}{'tok/s':>9}{'requests':>9}{'wall s':>9}{'TTFT p50':>10}"
               f"{'TTFT p99':>10}{'lat p50':>9}{'lat p99':>9}   (latencies in ms)")


def load_row(name: str, r: dict[str, Any]) -> str:
    """One line of a sustained chat load run (chat_load.py)."""
    return (f"{name:<22}{_num(r['tokens_per_s'], 1, 9, 1)}{r['requests']:>9}"
            f"{_num(r['wall_s'], 1, 9, 1)}{_num(r['ttft_p50_s'], MS, 10, 0)}"
            f"{_num(r['ttft_p99_s'], MS, 10, 0)}{_num(r['latency_p50_s'], MS, 9, 0)}"
            f"{_num(r['latency_p99_s'], MS, 9, 0)}")


def fleet_table(res: dict[str, Any]) -> list[str]:
    """The fleet run (`clients_per_port` clients on each engine's port) against one engine
    with the same clients, and the ratio of aggregate tok/s."""
    spread, single = res["fleet"], res["one_engine"]
    n = res["num_clients"]
    sustained = res.get("duration_s") is not None
    if sustained:
        what = (f"fleet benchmark: {n} closed-loop chat clients for {res['duration_s']:g} s "
                f"per side (max_tokens 16/64/128, greedy or seeded T=0.8, half streamed)")
        header, row = LOAD_HEADER, load_row
    else:
        what = (f"fleet benchmark: {n} concurrent streaming clients x {res['output_len']} "
                f"tokens (greedy, ignore_eos), HTTP /generate on loopback")
        header, row = HEADER, run_row
    out = [what,
           f"start-up: READY after {res['startup_s']:.1f} s, every engine's buckets compiled "
           f"after {res['all_compiled_s']:.1f} s (measured from there)", header,
           row(f"{res['num_engines']} engines, {res.get('clients_per_port', 1)} each", spread),
           row(f"1 engine, all {n}", single)]
    r = res["ratio"]
    same = (f"outputs identical across the two: {res['outputs_identical']}"
            + (f" ({res['compared_requests']} requests finished in both)" if sustained else ""))
    out.append(f"aggregate tok/s, fleet / one engine: "
               f"{'-' if r is None else f'{r:.2f}x'} (target >= {res['target']}x); {same}")
    return out


def _peer_lines(res: dict[str, Any]) -> list[str]:
    peer = res["peer"]
    out = [run_row(f"peer {peer['peer']}", peer)
           + f"   batch {peer['batch_size']}, {peer['threads']} threads, "
             f"RSS {peer['peak_rss_mb']:.0f} MiB, load {peer.get('load_s', 0):.0f} s", ""]
    if peer.get("seeding") and float(res.get("temperature") or 0.0) > 0:
        out.append(f"peer {peer['peer']} seeding: {peer['seeding']}")
    # outputs compared per stream: a single stream's rounds, else the prompts
    streams = int(res["ours"].get("rounds", res["num_prompts"]))
    out += comparison_table(res["ours"], peer, peer["peer"], res["peer_agreement"],
                            streams, int(res["output_len"]), res.get("peer_agreement_note"))
    return out


BREAKDOWN_ROWS = (  # (key, label); indented rows are parts of the forward
    ("forward", "forward (decoder program + head)"),
    ("products", "  products (layer matrices + head)"),
    ("attention", "  attention (all layers)"),
    ("other_device", "  other device work"),
    ("sampler", "sampler"),
    ("step_glue", "step glue (device step - forward - sampler)"),
    ("device_step", "device step (as the engine runs it)"),
    ("host", "host (wall - device step)"),
    ("wall_step", "wall step (run wall / decode steps)"),
)


def breakdown_table(bd: dict[str, Any]) -> list[str]:
    """The step-time breakdown (breakdown.py): component, ms, share of the wall step."""
    if "error" in bd:
        return [f"step-time breakdown failed: {bd['error']}"]
    out = [f"step-time breakdown: typical decode step, {bd['rows']} rows (forward at "
           f"T={bd['tokens']} tokens, head and sampler at R={bd['logit_rows']} rows), "
           f"mean context {bd['context_mean']:.0f} tokens, {bd['num_layers']} layers, "
           f"attention kernel {bd['attention_kernel']}; "
           f"{'one fused program' if bd.get('fused_step') else 'two programs'} a step; "
           f"each the best of {bd['rounds']} interleaved runs",
           f"{'component':<46}{'ms':>9}{'of wall step':>14}"]
    for key, label in BREAKDOWN_ROWS:
        share = bd["share_of_wall_step"].get(key)
        out.append(f"{label:<46}{_num(bd['ms'][key], 1, 9, 2)}"
                   f"{'-' if share is None else f'{share:.0%}':>14}")
    steady = bd["steady"]
    out.append(f"(wall step: the run's wall over its {bd['decode_steps']} decode steps, its "
               "prefill included; other device work = forward - products - attention: "
               "norms, RoPE, KV writes, gathers)")
    out.append(f"steady decode step (ITL p50): {_num(steady['decode_step_ms'], 1, 0, 2)} ms, "
               f"host beyond the device step there: {_num(steady['host_ms'], 1, 0, 2)} ms")
    if not math.isnan(steady.get("device_step_median_ms", math.nan)):
        out.append(f"device step's median over the rounds: "
                   f"{_num(steady['device_step_median_ms'], 1, 0, 2)} ms; the ITL p50 beyond "
                   f"it: {_num(steady['host_beyond_median_ms'], 1, 0, 2)} ms")
    out.append(f"R program alone (head, in-flight ids, sampler): "
               f"{_num(bd['parts_ms']['head_program'], 1, 0, 2)} ms")
    if not bd["parts_within_forward"]:
        out.append("WARNING: products + attention, timed alone, exceed the forward: the "
                   "host's load changed during the measurement (other device work < 0)")
    return out


def batch_report(res: dict[str, Any]) -> list[str]:
    """The batch run (N prompts at once): set-up, one row per run, the peer table."""
    p = res["prompt_tokens"]
    c = res["config"]
    out = [f"\nmultiserve bench — {res['model']} on {res['device']} ({res['dtype']})",
           f"{res['num_prompts']} prompts (prompt tokens: total {p['total']}, min {p['min']}, "
           f"mean {p['mean']:.0f}, max {p['max']}) x {res['output_len']} output tokens, "
           f"{sampling_label(res)}, ignore_eos, all submitted at once",
           f"engine: max_running_requests={c['max_running_requests']} "
           f"bs_paddings={c['precompile_bs_paddings']} "
           f"token_paddings={c['precompile_token_paddings']} "
           f"chunked_prefill={c['chunked_prefill_size']} page_size={c['page_size']}",
           f"{startup_line(res)}; {c['num_buckets']} buckets; "
           f"peak RSS {res['peak_rss_mb']:.0f} MiB", HEADER]
    for key in ("ours", "ours_ab"):
        if key in res:
            r = res[key]
            label = f"ours overlap={'on' if r['overlap'] else 'off'}"
            out.append(run_row(label, r) + f"   {r['steps']} steps, "
                       f"{r['mean_step_ms']:.0f} ms/step")
    if "peer" in res:
        out += _peer_lines(res)
        t = res["targets"]
        out.append(f"ours / peer tok/s: {res['ratio_vs_peer']:.2f}x "
                   f"(target >= {t['vs_peer']}x)")
    if res["overlap_ratio"] is not None:
        out.append(f"overlap on / off: {res['overlap_ratio']:.2f}x (target >= "
                   f"{res['targets']['overlap']}x); outputs identical: "
                   f"{res['overlap_outputs_identical']}")
    out.append(f"recompiles after warm-up (cache_miss_count): {res['cache_miss_count']}")
    if res.get("breakdown"):
        out += ["", *breakdown_table(res["breakdown"])]
    if res.get("host_phases"):
        out += ["", *host_phases_table(res["host_phases"])]
    return out


def host_phases_table(hp: dict[str, Any]) -> list[str]:
    """The engine thread's time per step pass, phase by phase (engine/host_phases.py):
    decode passes and the others side by side, mean ms per pass."""
    from multiserve.engine.host_phases import PHASES, WAIT_PHASES

    kinds = [k for k in ("decode", "other") if hp.get(k, {}).get("passes")]
    out = [f"{'host phases (ms per pass)':<28}" + "".join(f"{k:>10}" for k in kinds)]
    out.append(f"{'passes':<28}" + "".join(f"{hp[k]['passes']:>10}" for k in kinds))
    for phase in PHASES:
        label = phase + (" (waits)" if phase in WAIT_PHASES else "")
        out.append(f"{label:<28}" + "".join(_num(hp[k]['phase_ms'][phase], 1, 10, 3)
                                            for k in kinds))
    for label, key in (("host (wall - waits) mean", "host_ms"),
                       ("host p50", "host_p50_ms"), ("wall per pass", "wall_ms")):
        out.append(f"{label:<28}" + "".join(_num(hp[k][key], 1, 10, 3) for k in kinds))
    decode = hp.get("decode", {})
    if decode.get("decode_steps_p50", 1) > 1:  # K decode steps a dispatch
        out.append(f"{'decode steps per pass p50':<28}{decode['decode_steps_p50']:>10.0f}")
        for label, key in (("host per decode step mean", "host_per_step_ms"),
                           ("host per decode step p50", "host_per_step_p50_ms")):
            out.append(f"{label:<28}{decode[key]:>10.3f}")
    return out


def startup_line(res: dict[str, Any]) -> str:
    """Start-up: serving (covering buckets compiled) and every bucket compiled."""
    return (f"start-up: serving after {res['startup_s']:.1f} s (compile "
            f"{res['compile_s']:.1f} s), every bucket compiled after "
            f"{res['all_compiled_s']:.1f} s (measured from there)")


def _rounds_label(rounds: int, interleaved: bool = False) -> str:
    if rounds == 1:
        return "1 cold round on each side"
    if interleaved:
        return f"{rounds} cold rounds on each side, ours and the peer's alternating"
    return f"{rounds} cold rounds one after another on each side"


def single_report(res: dict[str, Any]) -> list[str]:
    """The single-stream run (one prompt, N tokens, streamed)."""
    t = res["targets"]
    interleaved = bool(res.get("peer", {}).get("interleaved"))
    out = [f"\nmultiserve bench --single-stream — {res['model']} on {res['device']} "
           f"({res['dtype']})",
           f"1 prompt ({res['prompt_tokens']['total']} tokens) x {res['output_len']} output "
           f"tokens, {sampling_label(res)}, ignore_eos, streamed (Engine.stream_sync), "
           f"{_rounds_label(res['ours'].get('rounds', 1), interleaved)}",
           startup_line(res), HEADER,
           run_row("ours", res["ours"]) + f"   {res['ours']['steps']} steps"]
    per_round = res["ours"].get("rounds_tokens_per_s") or []
    if len(per_round) > 1:
        out.append("ours, each round's tok/s: " + " ".join(f"{x:.1f}" for x in per_round)
                   + ("" if res.get("temperature") else
                      f"; greedy rounds identical: "
                      f"{'yes' if res['ours'].get('rounds_identical') else 'NO'}"))
    if "peer" in res:
        out += _peer_lines(res)
        peer_rounds = res["peer"].get("rounds_tokens_per_s") or []
        if interleaved and len(peer_rounds) > 1:
            out.append("peer, each round's tok/s (each after ours of the same index): "
                       + " ".join(f"{x:.1f}" for x in peer_rounds))
        if res["ratio_vs_peer"] is not None:
            out.append(f"ours / peer tok/s: {res['ratio_vs_peer']:.2f}x "
                       f"(target >= {t['vs_peer']}x)")
    out.append(f"TTFT {res['ttft_s'] * MS:.0f} ms (target < {t['ttft_s'] * MS:.0f} ms); "
               f"recompiles after warm-up: {res['cache_miss_count']}")
    return out
