"""The counts of scripts/db/kill-suite.py: per fault kind, database and mode, what was tried and
what came of it, as a table and as JSON."""
import json

COLUMNS = [  # (key, heading)
    ("rounds", "rounds"),
    ("acked", "acked"),
    ("verified", "verified"),
    ("lost", "lost"),
    ("integrity_errors", "integrity errors"),
    ("failed_in_fault", "failed in fault"),
    ("failed_outside", "failed outside"),
    ("ext4_error_rounds", "ext4 errors"),
]

LEGEND = """\
acked: commits acknowledged to the client in these rounds; verified: of those, present after
the round's recovery; lost: acknowledged commits (of any earlier round too) missing after a
round of this kind; integrity errors: rounds whose database check failed (integrity_check,
pg_amcheck --heapallindexed) or whose total differed from the sum of its rows, or after which
the database did not come back; failed in fault: transactions that failed to the client while
the backing store was failing; failed outside: transactions that failed before the kill
outside that window; ext4 errors: rounds in which ext4 met errors before the kill (its own
count, /sys/fs/ext4/DEV/errors_count)."""

EIO_SUMS = ("backing_errors", "writeback_batch_errors", "written_back_after", "acked_in_fault",
            "acked_after_fault")

class Tally:
    def __init__(self):
        self.rows = {}   # (db, mode, kind) -> counts
        self.runs = []   # one per bed: db, mode, kind, setup, fsck verdict, error
        self.rounds = [] # every round's record

    def add_round(self, db, mode, kind, r):
        self.rounds.append({"db": db, "mode": mode, "fault": kind, **r})
        row = self.rows.setdefault((db, mode, kind), {k: 0 for k, _ in COLUMNS})
        row["rounds"] += 1
        for k in ("acked", "verified", "lost", "failed_in_fault", "failed_outside"):
            row[k] += r[k]
        row["integrity_errors"] += 0 if r["db_ok"] else 1
        row["ext4_error_rounds"] += 1 if r["ext4_errors_met"] else 0
        if kind == "backing-eio" and "backing_errors" in r:
            x = row.setdefault("backing_eio", {k: 0 for k in EIO_SUMS + ("rounds_with_errors", "flush_failures")})
            for k in EIO_SUMS:
                x[k] += r[k]
            x["rounds_with_errors"] += 1 if r["backing_errors"] else 0
            x["flush_failures"] += 1 if r["flush_rc"] else 0
            x["log_said_failing"] = x.get("log_said_failing", 0) + (1 if r.get("log_said_failing") else 0)
            x["log_said_ok_again"] = x.get("log_said_ok_again", 0) + (1 if r.get("log_said_ok_again") else 0)
        if kind == "cleaner" and "dirty_share" in r:
            x = row.setdefault("cleaner", {"dirty_share_at_kill": [], "written_back_per_s_at_kill": [],
                                           "phases": {}, "written_back": 0, "stalls": 0})
            x["dirty_share_at_kill"].append(round(r["dirty_share"], 3))
            x["written_back_per_s_at_kill"].append(r["written_back_per_s_at_kill"])
            for k, v in r["phases"].items():
                x["phases"][k] = x["phases"].get(k, 0) + v
            x["written_back"] += r["written_back"]
            x["stalls"] += r["stalls"]

    def add_run(self, run):
        self.runs.append(run)

    def table(self):
        head = ["db", "mode", "fault"] + [h for _, h in COLUMNS]
        lines = [[db, mode, kind] + [str(c[k]) for k, _ in COLUMNS]
                 for (db, mode, kind), c in self.rows.items()]
        totals = {k: sum(c[k] for c in self.rows.values()) for k, _ in COLUMNS}
        lines.append(["all", "", ""] + [str(totals[k]) for k, _ in COLUMNS])
        widths = [max(len(x) for x in col) for col in zip(head, *lines)]
        fmt = lambda cells: "  ".join(c.ljust(w) if i < 3 else c.rjust(w)
                                      for i, (c, w) in enumerate(zip(cells, widths)))
        out = [fmt(head), fmt(["-" * w for w in widths])]
        out += [fmt(l) for l in lines[:-1]] + [fmt(["-" * w for w in widths]), fmt(lines[-1])]
        return "\n".join(out)

    def kind_lines(self):
        """What the backing-eio and cleaner rounds met, beyond the counts of the table."""
        out = []
        for (db, mode, kind), c in self.rows.items():
            if "backing_eio" in c:
                x = c["backing_eio"]
                out.append(f"  {db} {mode} backing-eio: {x['rounds_with_errors']} of {c['rounds']} rounds met "
                           f"backing errors ({x['backing_errors']} failed operations, "
                           f"{x['writeback_batch_errors']} failed write-back batches); "
                           f"{x['written_back_after']} blocks written back after the faults, "
                           f"{x['flush_failures']} failed flushes; {x['acked_in_fault']} commits "
                           f"acknowledged while the store failed, {x['acked_after_fault']} after it; "
                           f"the server's log said the store failing in {x.get('log_said_failing', 0)} "
                           f"rounds and ok again in {x.get('log_said_ok_again', 0)}")
            if "cleaner" in c:
                x = c["cleaner"]
                d, w = x["dirty_share_at_kill"], x["written_back_per_s_at_kill"]
                out.append(f"  {db} {mode} cleaner: dirty share at the kills {100 * min(d):.0f}-"
                           f"{100 * max(d):.0f} % (mean {100 * sum(d) / len(d):.0f} %); "
                           f"written back just before the kills {min(w)}-{max(w)} blocks/s; "
                           f"{x['written_back']} blocks written back in those rounds; {x['stalls']} writer "
                           f"stalls; the cleaner's phase in samples: "
                           + ", ".join(f"{k} {v}" for k, v in sorted(x["phases"].items(), key=lambda kv: -kv[1])))
        return "\n".join(out)

    def runs_table(self):
        out = []
        for r in self.runs:
            what = r["fsck"] if not r.get("error") else "ABORTED: " + r["error"].splitlines()[-1][:150]
            out.append(f"  {r['db']:8} {r['mode']:20} {r['kind']:11} {r['setup']}; fsck: {what}")
        return "\n".join(out)

    def json(self, full=False, **meta):
        """The counts and the runs (what fsck said in full where it was not clean); with full,
        every round's record and all fsck said."""
        runs = self.runs if full else [{k: v for k, v in r.items()
                                        if k != "fsck_text" or not r["fsck"].startswith("clean")}
                                       for r in self.runs]
        out = {**meta, "rows": [{"db": db, "mode": mode, "fault": kind, **c}
                                for (db, mode, kind), c in self.rows.items()], "runs": runs}
        if full:
            out["rounds"] = self.rounds
        return json.dumps(out)
