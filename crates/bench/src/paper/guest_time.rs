//! Where a request's time goes in the guest bed (`scripts/guest/paper000.sh`, figure
//! `000-time`): for each layer, one job at queue depth 1 on three of paper 000's workloads,
//! the CPU time each request costs — fio in user space and in the kernel, the server (a
//! user-space layer's process), everything else the guest ran (kernel threads, interrupts),
//! and idle — with the context switches and CPU migrations per request.
//!
//! The guest samples its counters over a window in the middle of each fio run (after fio's
//! start, before its end): `/proc/stat` for the whole guest, `/proc/<pid>/task/*` for fio's
//! processes and for the server's (`stat` for CPU ticks, `status` for voluntary and
//! involuntary switches, `sched` for migrations where the kernel has scheduler debugging).
//! The requests of the window are fio's IOPS times its length.

use serde::Deserialize;

use super::Ctx;
use super::figure::{Absolute, Figure, Point, Series, number};

/// One window of one fio run on one layer.
#[derive(Debug, Deserialize)]
pub struct TimeSample {
    /// `4K rand read`, `4M seq read`, `4K rand 50:50`.
    pub workload: String,
    /// The layer.
    pub series: String,
    /// The window's length.
    pub window_s: f64,
    /// fio's requests per second over its run (one job, QD 1).
    pub iops: f64,
    /// Clock ticks per second of the tick counts (`USER_HZ`).
    pub hz: f64,
    /// Ticks of the whole guest over the window, all CPUs summed (`/proc/stat`).
    pub system: SystemTicks,
    /// fio's processes over the window.
    pub fio: TaskAccount,
    /// The server's process over the window; none for a kernel layer.
    pub server: Option<TaskAccount>,
}

/// `/proc/stat`'s `cpu` line and `ctxt`, differences over the window.
#[derive(Debug, Deserialize)]
pub struct SystemTicks {
    /// User time.
    pub user: f64,
    /// Niced user time.
    pub nice: f64,
    /// Kernel time.
    pub system: f64,
    /// Idle.
    pub idle: f64,
    /// Idle waiting for I/O.
    pub iowait: f64,
    /// Hard interrupts.
    pub irq: f64,
    /// Soft interrupts.
    pub softirq: f64,
    /// Context switches of every CPU.
    pub ctxt: f64,
}

/// The threads of some processes, summed, differences over the window.
#[derive(Debug, Deserialize)]
pub struct TaskAccount {
    /// User ticks.
    pub user: f64,
    /// Kernel ticks.
    pub system: f64,
    /// Context switches, voluntary and involuntary.
    pub ctx: f64,
    /// CPU migrations (`se.nr_migrations`), where the kernel shows them.
    pub migrations: Option<f64>,
}

/// A sample's costs per request: CPU microseconds by whose, then events.
struct PerRequest {
    request_us: f64,
    cpu_us: [f64; 5],
    events: [Option<f64>; 5],
}

/// The CPU columns, in `PerRequest::cpu_us`'s order.
const CPU_COLUMNS: [&str; 5] =
    ["fio, user", "fio, kernel", "server", "other (kernel threads, interrupts)", "idle"];
/// The event columns, in `PerRequest::events`' order.
const EVENT_COLUMNS: [&str; 5] = [
    "context switches, all",
    "switches of fio",
    "switches of the server",
    "CPU migrations of fio",
    "migrations of the server",
];

fn per_request(s: &TimeSample) -> Option<PerRequest> {
    let requests = s.iops * s.window_s;
    if requests <= 0.0 || s.hz <= 0.0 {
        return None;
    }
    let us = |ticks: f64| ticks / s.hz * 1e6 / requests;
    let t = &s.system;
    let busy = t.user + t.nice + t.system + t.irq + t.softirq;
    let (server_cpu, server_ctx, server_migrations) = match &s.server {
        Some(a) => (a.user + a.system, Some(a.ctx), a.migrations),
        None => (0.0, Some(0.0), Some(0.0)),
    };
    let fio_cpu = s.fio.user + s.fio.system;
    let other = (busy - fio_cpu - server_cpu).max(0.0);
    Some(PerRequest {
        request_us: 1e6 / s.iops,
        cpu_us: [
            us(s.fio.user),
            us(s.fio.system),
            us(server_cpu),
            us(other),
            us(t.idle + t.iowait),
        ],
        events: [
            Some(t.ctxt / requests),
            Some(s.fio.ctx / requests),
            server_ctx.map(|c| c / requests),
            s.fio.migrations.map(|m| m / requests),
            server_migrations.map(|m| m / requests),
        ],
    })
}

/// The tick length of the samples' CPU counters, as the guest reported its `USER_HZ`.
fn tick_text(samples: &[&TimeSample]) -> String {
    let mut hz: Vec<f64> = samples.iter().map(|s| s.hz).filter(|&hz| hz > 0.0).collect();
    hz.sort_by(f64::total_cmp);
    hz.dedup();
    match hz.as_slice() {
        [] => "of a length the guest did not report".into(),
        [one] => format!("1/{} s", number(*one)),
        many => format!(
            "1/{} s (the runs disagree: {})",
            number(many[0]),
            many.iter().map(|&h| format!("1/{} s", number(h))).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// A workload's name as a figure id's part.
fn slug(workload: &str) -> String {
    match workload {
        "4K rand read" => "4k-read".into(),
        "4M seq read" => "4m-read".into(),
        "4K rand 50:50" => "4k-rw".into(),
        other => other.to_lowercase().replace([' ', ':'], "-"),
    }
}

/// One figure per workload: x the layers, the CPU time per request by whose, and the events
/// per request beside it.
pub fn figures(ctx: &Ctx, samples: &[TimeSample], bed: &str, seconds: f64) -> Vec<Figure> {
    let mut workloads: Vec<&str> = vec![];
    for s in samples {
        if !workloads.contains(&s.workload.as_str()) {
            workloads.push(&s.workload);
        }
    }
    let mut figures = vec![];
    for workload in workloads {
        let of: Vec<&TimeSample> = samples.iter().filter(|s| s.workload == workload).collect();
        let mut layers: Vec<&str> = vec![];
        for s in &of {
            if !layers.contains(&s.series.as_str()) {
                layers.push(&s.series);
            }
        }
        let costs: Vec<Vec<PerRequest>> = layers
            .iter()
            .map(|layer| {
                of.iter().filter(|s| s.series == *layer).filter_map(|s| per_request(s)).collect()
            })
            .collect();
        let column = |name: &str, value: &dyn Fn(&PerRequest) -> Option<f64>| Series {
            name: name.to_string(),
            points: costs
                .iter()
                .map(|runs| {
                    let values: Vec<f64> = runs.iter().filter_map(value).collect();
                    (!values.is_empty()).then(|| Point::of(&values, false))
                })
                .collect(),
        };
        let mut cpu = vec![column("request (1 / IOPS)", &|c| Some(c.request_us))];
        for (i, name) in CPU_COLUMNS.iter().enumerate() {
            cpu.push(column(name, &|c| Some(c.cpu_us[i])));
        }
        let events: Vec<Series> = EVENT_COLUMNS
            .iter()
            .enumerate()
            .map(|(i, name)| column(name, &|c| c.events[i]))
            .collect();
        let median = |series: &Series, x: usize| series.points[x].map(|p| p.median);
        let parts: Vec<String> = layers
            .iter()
            .enumerate()
            .filter_map(|(x, layer)| {
                let request = median(&cpu[0], x)?;
                let switches = median(&events[0], x)?;
                Some(format!("{layer} {} µs and {} switches", number(request), number(switches)))
            })
            .collect();
        figures.push(Figure {
            id: format!("000-time-{}-guest", slug(workload)),
            title: format!("where a request's time goes: {workload}, 1 job at QD 1"),
            bed: bed.to_string(),
            x_label: "layer".into(),
            x_ticks: layers.iter().map(|l| l.to_string()).collect(),
            y_label: "CPU µs per request".into(),
            y_log: false,
            bars: true,
            series: cpu,
            absolute: Some(Absolute { y_label: "per request".into(), series: events }),
            published: "The paper has no such figure: it says where a request's time goes in \
                        this guest, for each layer of Figs 4a, 4b and 6."
                .into(),
            ours: format!("Per request: {}.", parts.join("; ")),
            scale: ctx.scale_note_timed(vec![], seconds),
            notes: vec![
                "The CPU columns add up to the guest's CPUs times the request's time: a request \
                 of 100 µs on 2 vCPUs is 200 CPU µs, the idle part included."
                    .into(),
                "'fio, kernel' is the kernel work done in fio's own system calls, where bcache, \
                 dm-cache, dm-writecache and the raw NVDIMM do all their work; a user-space \
                 layer (ublk) does its part in 'server' and hands each request over between \
                 the two processes. 'other' is what no process of the experiment ran: kernel \
                 threads (a loop device's worker), interrupts, the shell that samples."
                    .into(),
                format!(
                    "Counters from /proc over a window in the middle of each run (its length: \
                     the run's seconds); CPU ticks are {}, so a column under a few µs is \
                     within their resolution.",
                    tick_text(&of)
                ),
            ],
            provenance: ctx.provenance.clone(),
        });
    }
    figures
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(series: &str, server: Option<TaskAccount>) -> TimeSample {
        TimeSample {
            workload: "4K rand read".into(),
            series: series.into(),
            window_s: 2.0,
            iops: 5000.0,
            hz: 100.0,
            system: SystemTicks {
                user: 150.0,
                nice: 0.0,
                system: 200.0,
                idle: 50.0,
                iowait: 0.0,
                irq: 0.0,
                softirq: 0.0,
                ctxt: 40_000.0,
            },
            fio: TaskAccount { user: 50.0, system: 100.0, ctx: 10_000.0, migrations: Some(100.0) },
            server,
        }
    }

    /// 10,000 requests over 2 s of 2 CPUs: 400 CPU µs each, split by whose.
    #[test]
    fn ticks_become_microseconds_per_request_by_whose() {
        let server = TaskAccount { user: 80.0, system: 70.0, ctx: 20_000.0, migrations: None };
        let c = per_request(&sample("pmcache (ublk)", Some(server))).expect("costs");
        assert!((c.request_us - 200.0).abs() < 1e-9);
        // fio user 50 ticks = 0.5 s over 10,000 requests = 50 µs; kernel 100 µs; server
        // 150 µs; other 350 - 300 = 50 ticks = 50 µs; idle 50 µs.
        let want = [50.0, 100.0, 150.0, 50.0, 50.0];
        for (got, want) in c.cpu_us.iter().zip(want) {
            assert!((got - want).abs() < 1e-9, "{:?}", c.cpu_us);
        }
        assert_eq!(c.events[0], Some(4.0));
        assert_eq!(c.events[1], Some(1.0));
        assert_eq!(c.events[2], Some(2.0));
        assert_eq!(c.events[3], Some(0.01));
        assert_eq!(c.events[4], None, "migrations unknown stay unknown");
        // A kernel layer has no server: its columns are zero, not missing.
        let k = per_request(&sample("bcache", None)).expect("costs");
        assert_eq!((k.cpu_us[2], k.events[2], k.events[4]), (0.0, Some(0.0), Some(0.0)));
    }

    #[test]
    fn one_figure_per_workload_with_a_column_per_cost() {
        let args = super::super::PaperArgs::smallest("000-guest", &std::env::temp_dir());
        let ctx = super::super::Ctx::new(&args, &crate::harness::experiment::Run::default());
        let mut other = sample("bcache", None);
        other.workload = "4M seq read".into();
        let samples = vec![sample("bcache", None), sample("bcache", None), other];
        let figures = figures(&ctx, &samples, "guest", 3.0);
        let ids: Vec<&str> = figures.iter().map(|f| f.id.as_str()).collect();
        assert_eq!(ids, ["000-time-4k-read-guest", "000-time-4m-read-guest"]);
        let f = &figures[0];
        assert_eq!(f.x_ticks, ["bcache"]);
        assert_eq!(f.series.len(), 1 + CPU_COLUMNS.len());
        assert_eq!(f.series[0].points[0].map(|p| p.median), Some(200.0));
        assert!(f.ours.contains("bcache 200 µs and 4.00 switches"), "{}", f.ours);
    }
}
