//! One measurement of `bench paper002`: the server, fio and the samplers.

use super::cpu::{RunSampler, Sampled, join_pi, spawn_pi};
use super::{CLEANER_APART, CLEANER_NICE, Config, Paper002Args, Plan, Sample};
use crate::harness::fio::{FioResult, FioRun, FioSpec, FioTarget, RAW_ENGINES, best_of_engines};
use crate::harness::scratch::{Scratch, settle};
use crate::harness::servers::{ServeOptions, Server, ServerFigures};

/// Everything a measurement needs.
pub(super) struct Bed<'a> {
    pub(super) args: &'a Paper002Args,
    pub(super) plan: &'a Plan,
    pub(super) scratch: &'a Scratch,
}

impl Bed<'_> {
    fn fio_spec<'s>(
        &'s self,
        target: FioTarget,
        writers: usize,
        seconds: f64,
        cpus: Option<&'s str>,
    ) -> FioSpec<'s> {
        FioSpec {
            fio: &self.args.scratch.fio,
            target,
            rw: "randwrite",
            bs: self.plan.bs,
            qd: self.plan.qd,
            jobs: writers,
            span: self.plan.span_bytes,
            seconds,
            out_dir: self.scratch.dir(),
            timeline: false,
            cpus,
        }
    }

    /// Starts the server with its threads confined to `cpu_list` (fio's writers run there
    /// too); with `adaptive` [`CLEANER_APART`], boost off and the cleaner alone on CPU 1.
    fn start_server(
        &self,
        cpu_list: &str,
        writers: usize,
        adaptive: &str,
    ) -> Result<Server, String> {
        let apart = adaptive == CLEANER_APART;
        let mut cleaner = match adaptive {
            CLEANER_APART => vec!["adaptive=off".to_string()],
            // The boost taken from everything on the cleaner's CPUs: the cleaner's own nice
            // value lowered, the writers' unchanged.
            CLEANER_NICE => {
                ["adaptive=boost", "nice_boost=-10", "nice_writers=0"].map(String::from).to_vec()
            }
            _ => vec![format!("adaptive={adaptive}")],
        };
        cleaner.extend(self.plan.cleaner.iter().cloned());
        let options = ServeOptions { cleaner_cpu: apart.then_some(1), ..ServeOptions::default() };
        self.scratch.serve(
            self.plan.cache_bytes,
            writers.max(16),
            &cleaner,
            Some(cpu_list),
            options,
        )
    }

    /// One main-table measurement in run `run` (from 0). The raw file's is the best of
    /// fio's engines, each measured now, the first engine turning with the run.
    pub(super) fn measure(&self, config: &Config, run: usize) -> Result<Sample, String> {
        let Some(cpus) = config.cpus else {
            let path = self.scratch.backing.clone();
            let (fio, engines) = best_of_engines(
                &RAW_ENGINES,
                run,
                |engine| {
                    settle(&self.scratch.backing)?;
                    let target = FioTarget::File { path: path.clone(), engine };
                    FioRun::run(&self.fio_spec(target, config.writers, self.plan.seconds, None))
                },
                |r| r.iops,
            )?;
            let mut raw = sample(fio, None, None, None, false);
            raw.raw_engines = engines;
            return Ok(raw);
        };
        settle(&self.scratch.backing)?;
        let cpu_list = cpu_list(cpus);
        let server = self.start_server(&cpu_list, config.writers, &config.adaptive)?;
        let before = ServerFigures::from_stats(&server.stats()?);
        let sampler = RunSampler::start(server.pid(), server.control());
        let target = FioTarget::Nbd(server.uri());
        let spec = self.fio_spec(target, config.writers, self.plan.seconds, Some(&cpu_list));
        let fio = FioRun::run(&spec);
        let sampled = sampler.finish();
        let fio = fio?;
        let after = ServerFigures::from_stats(&server.stats()?);
        server.stop()?;
        Ok(sample(fio, Some(after.since(&before)), Some(sampled), None, false))
    }

    /// One Table 1 measurement: the server on CPU 0 and the π job on CPU 0; fio runs until
    /// the π job ends.
    pub(super) fn measure_with_pi(
        &self,
        writers: usize,
        adaptive: &str,
        terms: u64,
    ) -> Result<Sample, String> {
        settle(&self.scratch.backing)?;
        let server = self.start_server("0", writers, adaptive)?;
        let before = ServerFigures::from_stats(&server.stats()?);
        let sampler = RunSampler::start(server.pid(), server.control());
        // A limit far beyond the π job's expected time; fio is interrupted when it ends.
        let limit = self.plan.pi_seconds * 8.0 + 30.0;
        let target = FioTarget::Nbd(server.uri());
        let mut fio = FioRun::spawn(&self.fio_spec(target, writers, limit, Some("0")))?;
        let pi = spawn_pi(terms);
        let pi_time = join_pi(pi);
        let fio_ended_first = !fio.running();
        fio.interrupt();
        let fio = fio.wait();
        let sampled = sampler.finish();
        let (fio, pi_time) = (fio?, pi_time?);
        let after = ServerFigures::from_stats(&server.stats()?);
        server.stop()?;
        Ok(sample(
            fio,
            Some(after.since(&before)),
            Some(sampled),
            Some(pi_time.as_secs_f64()),
            fio_ended_first,
        ))
    }
}

/// CPUs 0 to `cpus` - 1, as a CPU list.
fn cpu_list(cpus: usize) -> String {
    if cpus == 1 { "0".to_string() } else { format!("0-{}", cpus - 1) }
}

pub(super) fn sample(
    fio: FioResult,
    server: Option<ServerFigures>,
    sampled: Option<Sampled>,
    pi_seconds: Option<f64>,
    fio_ended_first: bool,
) -> Sample {
    let counters = sampled.as_ref().map(|x| x.counters.clone()).unwrap_or_default();
    let boosted_s = server.as_ref().map(|s| {
        let open = sampled.as_ref().filter(|_| s.boosted_now).map_or(0.0, |x| x.open_boost_s);
        s.boosted_ns as f64 / 1e9 + open
    });
    Sample {
        run: 0,
        mb_per_s: fio.bytes_per_s / 1e6,
        fio,
        server,
        context_switches: sampled.map(|x| x.switches),
        counters,
        raw_engines: Vec::new(),
        boosted_s,
        pi_seconds,
        fio_ended_first,
    }
}
