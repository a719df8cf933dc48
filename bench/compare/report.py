"""The output of ``bench/compare``: the throughput table (median msg/s per
side, the per-round ratio, broker CPU per message), the back-pressure table,
and the JSON object on the last line. bench/README.md explains every field."""

from __future__ import annotations

import collections
import json
import statistics

from .workloads import BP_COUNTS, BP_MAX, BP_WINDOWS


def med(runs: list[dict], field: str = "msgs_per_s") -> float:
    return statistics.median(r[field] for r in runs) if runs else 0


def us_per_msg(runs: list[dict]) -> float:
    return statistics.median(1e6 * r["broker_cpu_s"] / max(1, r["count"]) for r in runs) if runs else 0


def method_lines(args) -> str:
    """How the qflow side's throughput figures were measured, in the words
    ``make bench`` uses for its own, and what differs (bench/README.md says why)."""
    return ("method, qflow side: as make bench's 64b and 1k: 1 producer + 1 consumer process per queue, capacity 1000, "
            "credit 1000, accept=auto, no flow control;\n"
            "  Sender.send / Receiver.fetch one message per call, every body read; msg/s = count / (first send -> last "
            "message received); the median of the rounds.\n"
            f"  Unlike make bench: each producer publishes for {args.duration:g} s (count: column 'qflow msgs/run'), "
            "the consumer stops at an END marker (reading the clock every 64 messages), one qflowd serves the "
            f"whole run with RabbitMQ idle beside it, {args.rounds} round(s).")


def report(args, bench, rss: dict, rabbitmq_version: str | None, spin_before: float, spin_after: float,
           extra: dict | None = None) -> None:
    """Print the tables and the JSON line; ``extra``'s keys (the latency beside qpidd) join the JSON."""
    results, best, bp = bench.results, bench.best, bench.bp
    ratios, per_client, rows = {}, collections.defaultdict(dict), []
    for key, by_lib in results.items():
        b = best.get(key)
        if not by_lib.get("qflow") or not b:
            continue
        # Each round's qflow/RabbitMQ pair ran back to back; the median of the pair
        # ratios cancels the machine's drift between rounds.
        rmq_by_round = {r["round"]: r for r in by_lib[b]}
        pair = [q["msgs_per_s"] / rmq_by_round[q["round"]]["msgs_per_s"] for q in by_lib["qflow"]
                if q["round"] in rmq_by_round]
        ratios[key] = round(statistics.median(pair), 2) if pair else None
        for lib, runs in by_lib.items():
            if lib != "qflow":
                per_client[lib][key] = round(med(runs))
        rows.append((key, round(med(by_lib["qflow"])), round(med(by_lib[b])), b, ratios[key],
                     round(med(by_lib["qflow"], "count")), statistics.median(bench.spins[key]),
                     us_per_msg(by_lib["qflow"]), us_per_msg(by_lib[b])))
    print()
    print(method_lines(args))
    print(f"machine-speed probe (bench/run.py's spin loop; lower: a faster machine): {spin_before:.3f} s before the "
          f"run, {spin_after:.3f} s after; column 'spin s': the median of the probes before each of the row's rounds")
    print("throughput, median msg/s of the rounds; ratio = median of the per-round qflow/RabbitMQ ratios")
    print(f"{'workload':<13}{'qflow':>9}{'RabbitMQ':>10}  {'client':<9}{'ratio':>7}{'qflow msgs/run':>16}{'spin s':>8}"
          "   broker CPU us/msg: qflow  RabbitMQ")
    for key, q, rb, b, ratio, n, spin, qc, rc in rows:
        print(f"{key:<13}{q:>9}{rb:>10}  {b:<9}{(ratio or 0):>6.1f}x{n:>16}{spin:>8.3f}{qc:>27.1f}{rc:>10.1f}")
    if per_client:
        keys = [k for k in results if any(k in v for v in per_client.values())]
        print("RabbitMQ clients, median msg/s: " + "  ".join(
            f"{lib}: " + ", ".join(f"{k} {vals[k]}" for k in keys if k in vals) for lib, vals in per_client.items()))
    bp_summary = {}
    if bp:
        print()
        print(f"back-pressure: {sum(BP_COUNTS)} messages from 3 producers (windows {'/'.join(map(str, BP_WINDOWS))}), "
              f"limit {BP_MAX}, consumer {args.bp_rate:g} msg/s; medians ({args.rounds} run(s), lost/peak: worst)")
        print(f"{'':<20}{'lost':>6}{'resends':>9}{'publishes':>11}{'peak depth':>12}{'wall s':>8}"
              f"{'broker CPU s':>14}{'producer CPU s':>16}")
        for lib, runs in bp.items():
            side = "qflow" if lib == "qflow" else "rabbitmq"
            m = {c: med(runs, c) for c in ("resends", "nacks", "publishes", "duplicates", "wall_s", "broker_cpu_s",
                                           "producer_cpu_s", "consumer_cpu_s")}
            m = {k: round(v, 3) if isinstance(v, float) else v for k, v in m.items()}
            m["lost"] = max(r["lost"] for r in runs)  # the worst run, not the median
            m["peak_depth"] = max(r["peak_depth"] for r in runs)
            m["timed_out"] = any(r["timed_out"] for r in runs)
            m["client"] = lib
            m["runs"] = len(runs)
            bp_summary[side] = m
            print(f"{side + ' (' + lib + ')':<20}{m['lost']:>6}{m['resends']:>9.0f}{m['publishes']:>11.0f}"
                  f"{m['peak_depth']:>12}{m['wall_s']:>8.2f}{m['broker_cpu_s']:>14.2f}{m['producer_cpu_s']:>16.2f}")
    out = {
        "ratio_vs_rabbitmq": ratios,
        "rabbitmq_client": best.get("1p1c_64b"),
        "rabbitmq_client_per_workload": best,
        "rabbitmq_clients_msgs_per_s": per_client,
        "qflow_msgs_per_s": {k: round(med(v["qflow"])) for k, v in results.items()},
        "rabbitmq_msgs_per_s": {k: round(med(v[best[k]])) for k, v in results.items() if k in best},
        # the flow workload: how often qflow stopped its producers, how often RabbitMQ's made them resend
        "flow_events": {k: {"qflow_flow_stops": med(v["qflow"], "flow_stops") if v["qflow"] else None,
                            "rabbitmq_resends": med(v[best[k]], "resends"),
                            # the slow consumers' share of the run spent resting: 0.75 keeps the pace
                            "qflow_consumer_rested": med(v["qflow"], "consumer_rested") if v["qflow"] else None,
                            "rabbitmq_consumer_rested": med(v[best[k]], "consumer_rested")}
                        for k, v in results.items() if k.startswith("flow_") and k in best},
        "backpressure": bp_summary,
        "broker_peak_rss": rss,
        "rabbitmq_version": rabbitmq_version,
        "rounds": args.rounds,
        "duration_s": args.duration,
        "quick": args.quick,
        "spin_loop_s": [round(spin_before, 3), round(spin_after, 3)],
        "spin_loop_s_per_workload": {k: [round(x, 3) for x in v] for k, v in bench.spins.items()},
        # RabbitMQ's own CPU while it idled beside each qflow run: load make bench's runs do not have
        "rabbitmq_idle_cpu_s_during_qflow": {k: med(v["qflow"], "idle_broker_cpu_s") for k, v in results.items()
                                             if v["qflow"]},
        "qflow_msgs_per_run": {k: round(med(v["qflow"], "count")) for k, v in results.items() if v["qflow"]},
        "failures": bench.failures,
        **(extra or {}),
    }
    print(json.dumps(out))
