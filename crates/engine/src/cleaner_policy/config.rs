//! The cleaner's settings: order, watermarks, rate controller, priorities, queue. Every field
//! can be set at start and changed while the cleaner runs (`Engine::set_cleaner_settings`;
//! the queue's size at the next start).

use std::fmt;
use std::str::FromStr;

/// In which order the cleaner writes dirty blocks back.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum WriteBackOrder {
    /// By block number, as an elevator sweeping the device from where the last batch ended:
    /// random writes reach the backing store as ascending runs, adjacent blocks merged into
    /// one write.
    #[default]
    Lba,
    /// Oldest write first (by sequence number): the dirty data that has waited longest goes
    /// first, adjacent blocks still merged when they happen to be next to each other.
    Oldest,
    /// No cleaner: dirty blocks are written back only by a writer that needs a slot (inline),
    /// by `flush`/`drain` and at detach. Kept to compare against.
    None,
}

impl WriteBackOrder {
    /// Every order, for help texts and tests.
    pub const ALL: [WriteBackOrder; 3] =
        [WriteBackOrder::Lba, WriteBackOrder::Oldest, WriteBackOrder::None];

    /// The order's name, as settings and statistics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            WriteBackOrder::Lba => "lba",
            WriteBackOrder::Oldest => "oldest",
            WriteBackOrder::None => "none",
        }
    }
}

impl fmt::Display for WriteBackOrder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for WriteBackOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        WriteBackOrder::ALL
            .into_iter()
            .find(|o| o.as_str() == s)
            .ok_or_else(|| format!("unknown write-back order {s:?}; expected lba, oldest or none"))
    }
}

/// How the cleaner adapts to the foreground (paper 002).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Adaptive {
    /// Fixed priority; cleans at full speed above the high watermark until below the low
    /// one, and when the foreground is idle, down to the target.
    Off,
    /// As `Off`, and the cleaner gains priority while writers stall or dirty data is above
    /// the high watermark, until it is below the low one: its own nice value goes to
    /// `nice_boost` and its writers' to `nice_writers` (by default the writers yield and the
    /// cleaner keeps its value, so a boost takes no CPU from the machine's other programs).
    Boost,
    /// As `Boost`, and between the target and the high watermark the cleaner writes back at
    /// the rate a PID controller sets from the distance to the target.
    #[default]
    BoostPid,
}

impl Adaptive {
    /// Every mode, for help texts and tests.
    pub const ALL: [Adaptive; 3] = [Adaptive::Off, Adaptive::Boost, Adaptive::BoostPid];

    /// The mode's name, as settings and statistics spell it.
    pub fn as_str(self) -> &'static str {
        match self {
            Adaptive::Off => "off",
            Adaptive::Boost => "boost",
            Adaptive::BoostPid => "boost-pid",
        }
    }

    /// Whether the cleaner's priority is raised under pressure.
    pub fn boosts(self) -> bool {
        !matches!(self, Adaptive::Off)
    }

    /// Whether the PID rate controller runs between the target and the high watermark.
    pub fn controls_rate(self) -> bool {
        matches!(self, Adaptive::BoostPid)
    }
}

impl fmt::Display for Adaptive {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Adaptive {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Adaptive::ALL
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| format!("unknown adaptive mode {s:?}; expected off, boost or boost-pid"))
    }
}

/// The cleaner's settings. The defaults need no tuning: a quarter of the cache may stay dirty
/// (overwrites of hot blocks never reach the backing store), the cleaner works at full speed
/// from 60 % down to 50 % dirty and at the controller's rate between 25 % and 60 %.
#[derive(Clone, Debug, PartialEq)]
pub struct CleanerConfig {
    /// Write-back order; `None` runs no cleaner.
    pub order: WriteBackOrder,
    /// Priority boosting and rate control.
    pub adaptive: Adaptive,
    /// Dirty share of the cache the cleaner steers toward, in percent: below it the cleaner
    /// rests (unless the foreground is idle, then it cleans down to `idle_target_pct`).
    pub target_pct: u32,
    /// Dirty share above which the cleaner writes back at full speed (boosted), in percent.
    pub high_pct: u32,
    /// Dirty share at which full-speed cleaning stops again, in percent.
    pub low_pct: u32,
    /// Dirty share idle cleaning goes down to, in percent.
    pub idle_target_pct: u32,
    /// The foreground counts as idle after this long without a write, in milliseconds.
    pub idle_ms: u64,
    /// Most writes the cleaner keeps in flight at the backing store. Its queue and buffers are
    /// sized when the cleaner is made: a change while it runs takes effect at the next start.
    pub queue_depth: usize,
    /// Most blocks one batch writes back before its `fdatasync`.
    pub batch_blocks: usize,
    /// Most adjacent blocks merged into one backing write. A change while the cleaner runs
    /// may lower it; raising it above the value it started with takes effect at the next start.
    pub merge_blocks: usize,
    /// PID gains, per second: the rate in blocks per second is
    /// `kp * e + ki * ∫e dt + kd * de/dt`, `e` being dirty blocks above the target.
    pub kp: f64,
    /// Integral gain (per second squared); the integral is held while the rate is clamped.
    pub ki: f64,
    /// Derivative gain (dimensionless).
    pub kd: f64,
    /// The controlled rate's floor and ceiling, in blocks per second.
    pub rate_min: f64,
    /// See `rate_min`.
    pub rate_max: f64,
    /// The cleaner thread's nice value at rest.
    pub nice_base: i32,
    /// Its nice value while boosted (lower is more CPU).
    pub nice_boost: i32,
    /// The nice value of the threads that write through the engine while the cleaner is
    /// boosted (higher is less CPU); at or below `nice_base`, writers keep theirs. A boost by
    /// `nice_boost` takes the CPU from everything on the cleaner's CPUs; by `nice_writers`
    /// from its own writers only, the threads it is behind.
    pub nice_writers: i32,
    /// How long a writer that finds no free or clean slot waits for the cleaner before its
    /// write fails, in milliseconds (a hung backing device).
    pub stall_timeout_ms: u64,
    /// Dirty share above which writers are paced (write-back and write-only modes), in
    /// percent: the cache's writes are spread to the cleaner's measured write-back rate, scaled
    /// down linearly to nothing at 100 % — as the kernel's dirty-page throttle does — so that a
    /// foreground faster than the backing store waits a little on each write rather than a
    /// lot on a few (a stall lasts a whole batch and its flush). Pacing starts at the higher
    /// of this and `high_pct` (where the cleaner already runs at full speed); 100 turns it off.
    pub throttle_pct: u32,
}

impl Default for CleanerConfig {
    fn default() -> Self {
        Self {
            order: WriteBackOrder::Lba,
            adaptive: Adaptive::BoostPid,
            target_pct: 25,
            high_pct: 60,
            low_pct: 50,
            idle_target_pct: 0,
            idle_ms: 1000,
            queue_depth: 64,
            batch_blocks: 1024,
            merge_blocks: 32,
            kp: 1.0 / 8.0,
            ki: 1.0 / 256.0,
            kd: 0.0,
            rate_min: 64.0,
            rate_max: 1.0e6,
            nice_base: 0,
            // The boost is taken from the cleaner's own writers, not from the machine's other
            // programs: measured in docs/PERFORMANCE.md ("paper 002").
            nice_boost: 0,
            nice_writers: 10,
            stall_timeout_ms: 30_000,
            throttle_pct: 80,
        }
    }
}

/// The dirty-block counts the percentages of [`CleanerConfig`] stand for in one cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirtyThresholds {
    /// `target_pct` of the slots.
    pub target: u64,
    /// `high_pct` of the slots.
    pub high: u64,
    /// `low_pct` of the slots.
    pub low: u64,
    /// `idle_target_pct` of the slots.
    pub idle_target: u64,
}

/// The settable keys, in the order `describe` lists them.
pub const CLEANER_KEYS: [&str; 20] = [
    "order",
    "adaptive",
    "target_pct",
    "high_pct",
    "low_pct",
    "idle_target_pct",
    "idle_ms",
    "queue_depth",
    "batch_blocks",
    "merge_blocks",
    "kp",
    "ki",
    "kd",
    "rate_min",
    "rate_max",
    "nice_base",
    "nice_boost",
    "nice_writers",
    "stall_timeout_ms",
    "throttle_pct",
];

fn parse<T: FromStr>(key: &str, value: &str) -> Result<T, String> {
    value.parse().map_err(|_| format!("{key}: {value:?} is not a valid value"))
}

impl CleanerConfig {
    /// Sets one setting by its key (`target_pct=30`), checking the result as a whole.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), String> {
        let mut next = self.clone();
        match key {
            "order" => next.order = value.parse()?,
            "adaptive" => next.adaptive = value.parse()?,
            "target_pct" => next.target_pct = parse(key, value)?,
            "high_pct" => next.high_pct = parse(key, value)?,
            "low_pct" => next.low_pct = parse(key, value)?,
            "idle_target_pct" => next.idle_target_pct = parse(key, value)?,
            "idle_ms" => next.idle_ms = parse(key, value)?,
            "queue_depth" => next.queue_depth = parse(key, value)?,
            "batch_blocks" => next.batch_blocks = parse(key, value)?,
            "merge_blocks" => next.merge_blocks = parse(key, value)?,
            "kp" => next.kp = parse(key, value)?,
            "ki" => next.ki = parse(key, value)?,
            "kd" => next.kd = parse(key, value)?,
            "rate_min" => next.rate_min = parse(key, value)?,
            "rate_max" => next.rate_max = parse(key, value)?,
            "nice_base" => next.nice_base = parse(key, value)?,
            "nice_boost" => next.nice_boost = parse(key, value)?,
            "nice_writers" => next.nice_writers = parse(key, value)?,
            "stall_timeout_ms" => next.stall_timeout_ms = parse(key, value)?,
            "throttle_pct" => next.throttle_pct = parse(key, value)?,
            _ => {
                return Err(format!(
                    "unknown cleaner setting {key:?}; expected one of {}",
                    CLEANER_KEYS.join(", ")
                ));
            }
        }
        next.validate()?;
        *self = next;
        Ok(())
    }

    /// Sets `key=value` pairs, all or none.
    pub fn set_all<'a>(&mut self, pairs: impl IntoIterator<Item = &'a str>) -> Result<(), String> {
        let mut next = self.clone();
        for pair in pairs {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| format!("{pair:?} is not of the form key=value"))?;
            next.set(key.trim(), value.trim())?;
        }
        *self = next;
        Ok(())
    }

    /// `(key, value)` of every setting.
    pub fn describe(&self) -> Vec<(&'static str, String)> {
        let values = [
            self.order.to_string(),
            self.adaptive.to_string(),
            self.target_pct.to_string(),
            self.high_pct.to_string(),
            self.low_pct.to_string(),
            self.idle_target_pct.to_string(),
            self.idle_ms.to_string(),
            self.queue_depth.to_string(),
            self.batch_blocks.to_string(),
            self.merge_blocks.to_string(),
            self.kp.to_string(),
            self.ki.to_string(),
            self.kd.to_string(),
            self.rate_min.to_string(),
            self.rate_max.to_string(),
            self.nice_base.to_string(),
            self.nice_boost.to_string(),
            self.nice_writers.to_string(),
            self.stall_timeout_ms.to_string(),
            self.throttle_pct.to_string(),
        ];
        CLEANER_KEYS.into_iter().zip(values).collect()
    }

    /// The thresholds in blocks for a cache of `slots` slots.
    pub fn thresholds(&self, slots: u64) -> DirtyThresholds {
        let of = |pct: u32| slots * u64::from(pct) / 100;
        DirtyThresholds {
            target: of(self.target_pct),
            high: of(self.high_pct),
            low: of(self.low_pct),
            idle_target: of(self.idle_target_pct),
        }
    }

    /// Refuses settings that cannot work together.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.idle_target_pct <= self.target_pct
            && self.target_pct <= self.low_pct
            && self.low_pct < self.high_pct
            && self.high_pct <= 100)
        {
            return Err(format!(
                "the dirty thresholds must satisfy idle_target_pct <= target_pct <= low_pct < \
                 high_pct <= 100 (got {} <= {} <= {} < {} <= 100)",
                self.idle_target_pct, self.target_pct, self.low_pct, self.high_pct
            ));
        }
        if self.throttle_pct > 100 {
            return Err(format!("throttle_pct {} is above 100", self.throttle_pct));
        }
        if !(1..=4096).contains(&self.queue_depth) {
            return Err(format!("queue_depth {} is not within 1..=4096", self.queue_depth));
        }
        if !(1..=1 << 20).contains(&self.batch_blocks) {
            return Err(format!("batch_blocks {} is not within 1..=1048576", self.batch_blocks));
        }
        if !(1..=1024).contains(&self.merge_blocks) {
            return Err(format!("merge_blocks {} is not within 1..=1024", self.merge_blocks));
        }
        let gains = [("kp", self.kp), ("ki", self.ki), ("kd", self.kd)];
        if let Some((name, value)) = gains.iter().find(|(_, v)| !(v.is_finite() && *v >= 0.0)) {
            return Err(format!("{name} {value} must be a finite number >= 0"));
        }
        if !(self.rate_min.is_finite()
            && self.rate_max.is_finite()
            && 0.0 < self.rate_min
            && self.rate_min <= self.rate_max)
        {
            return Err(format!(
                "rate_min {} and rate_max {} must satisfy 0 < rate_min <= rate_max",
                self.rate_min, self.rate_max
            ));
        }
        for (name, nice) in [
            ("nice_base", self.nice_base),
            ("nice_boost", self.nice_boost),
            ("nice_writers", self.nice_writers),
        ] {
            if !(-20..=19).contains(&nice) {
                return Err(format!("{name} {nice} is not a nice value (-20..=19)"));
            }
        }
        if self.nice_boost > self.nice_base {
            return Err(format!(
                "nice_boost {} is above nice_base {}: a boost must not lower the priority",
                self.nice_boost, self.nice_base
            ));
        }
        if self.stall_timeout_ms == 0 {
            return Err("stall_timeout_ms must be at least 1".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_are_valid_and_every_key_round_trips() {
        let defaults = CleanerConfig::default();
        defaults.validate().expect("defaults valid");
        let mut copy = CleanerConfig { order: WriteBackOrder::None, ..defaults.clone() };
        for (key, value) in defaults.describe() {
            copy.set(key, &value).unwrap_or_else(|e| panic!("{key}={value}: {e}"));
        }
        assert_eq!(copy, defaults);
        assert_eq!(defaults.describe().len(), CLEANER_KEYS.len());
    }

    #[test]
    fn settings_that_cannot_work_are_refused_and_change_nothing() {
        let mut config = CleanerConfig::default();
        for (pair, says) in [
            ("low_pct=70", "thresholds"),
            ("target_pct=55", "thresholds"),
            ("high_pct=101", "thresholds"),
            ("queue_depth=0", "queue_depth"),
            ("kp=-1", "kp"),
            ("rate_min=0", "rate_min"),
            ("nice_boost=5", "nice_boost"),
            ("nice_base=40", "nice value"),
            ("order=random", "lba, oldest or none"),
            ("adaptive=max", "off, boost or boost-pid"),
            ("bogus=1", "unknown cleaner setting"),
            ("idle_ms=soon", "not a valid value"),
            ("target_pct", "key=value"),
        ] {
            let err = config.set_all([pair]).unwrap_err();
            assert!(err.contains(says), "{pair}: {err}");
        }
        assert_eq!(config, CleanerConfig::default());
        // All or none: a valid pair before an invalid one is not applied either.
        assert!(config.set_all(["target_pct=10", "low_pct=5"]).is_err());
        assert_eq!(config, CleanerConfig::default());
        config.set_all(["target_pct=10", "order=oldest", "adaptive=off"]).expect("valid");
        assert_eq!(
            (config.target_pct, config.order, config.adaptive),
            (10, WriteBackOrder::Oldest, Adaptive::Off)
        );
    }
}
