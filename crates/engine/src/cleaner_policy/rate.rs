//! The cleaner's rate controller: a PID controller from the dirty blocks above the target to
//! a write-back rate in blocks per second, with anti-windup (bcache's write-back rate is the
//! P and I of it; paper 002 names PID as the next step for its writer daemon).

/// One controller step's terms, for the statistics.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RateTerms {
    /// Dirty blocks above the target (negative below it).
    pub error_blocks: f64,
    /// `kp * error`, blocks per second.
    pub proportional: f64,
    /// `ki * ∫error dt`, blocks per second.
    pub integral: f64,
    /// `kd * d(error)/dt`, blocks per second.
    pub derivative: f64,
    /// The rate after clamping, blocks per second.
    pub rate: f64,
}

/// A PID controller whose output is clamped to `[rate_min, rate_max]`. The integral only
/// accumulates while that does not push the output further into a clamp it is already at
/// (conditional integration), so a long time below or above the target does not leave a
/// wound-up integral that takes as long to unwind.
#[derive(Clone, Debug, Default)]
pub struct RateController {
    integral_blocks_s: f64,
    last_error: Option<f64>,
}

impl RateController {
    /// A controller with nothing accumulated.
    pub fn new() -> Self {
        Self::default()
    }

    /// Forgets the integral and the last error (after the cleaner rested below the target,
    /// or its gains changed).
    pub fn reset(&mut self) {
        *self = Self::default();
    }

    /// One step: the rate for `error_blocks` (dirty blocks above the target) after `dt_s`
    /// seconds since the last step.
    pub fn update(
        &mut self,
        error_blocks: f64,
        dt_s: f64,
        gains: (f64, f64, f64),
        rate_min: f64,
        rate_max: f64,
    ) -> RateTerms {
        let (kp, ki, kd) = gains;
        let dt_s = dt_s.max(1e-6);
        let proportional = kp * error_blocks;
        let derivative = match self.last_error {
            Some(last) => kd * (error_blocks - last) / dt_s,
            None => 0.0,
        };
        self.last_error = Some(error_blocks);
        let candidate = self.integral_blocks_s + error_blocks * dt_s;
        let unclamped = proportional + ki * candidate + derivative;
        // Integrate only when the output is inside its range, or when this step's error
        // pulls it back toward the range.
        let saturated_high = unclamped > rate_max && error_blocks > 0.0;
        let saturated_low = unclamped < rate_min && error_blocks < 0.0;
        if !(saturated_high || saturated_low) {
            self.integral_blocks_s = candidate;
        }
        // Never negative: a negative integral would only delay the response to new dirt.
        self.integral_blocks_s = self.integral_blocks_s.max(0.0);
        let integral = ki * self.integral_blocks_s;
        let rate = (proportional + integral + derivative).clamp(rate_min, rate_max);
        RateTerms { error_blocks, proportional, integral, derivative, rate }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GAINS: (f64, f64, f64) = (0.5, 0.1, 0.0);

    #[test]
    fn the_rate_is_proportional_plus_integral_clamped() {
        let mut c = RateController::new();
        let t = c.update(1000.0, 1.0, GAINS, 10.0, 1e6);
        assert_eq!(t.proportional, 500.0);
        assert_eq!(t.integral, 100.0, "0.1 × 1000 blocks × 1 s");
        assert_eq!(t.rate, 600.0);
        let t = c.update(1000.0, 1.0, GAINS, 10.0, 1e6);
        assert_eq!((t.integral, t.rate), (200.0, 700.0), "the integral grows with time");
        let t = c.update(-1000.0, 1.0, GAINS, 10.0, 1e6);
        assert_eq!(t.rate, 10.0, "below the target: the floor");
    }

    /// Held at the ceiling for a long time, the integral does not wind up: once the error
    /// falls, the rate falls at once instead of staying at the ceiling while a huge integral
    /// unwinds.
    #[test]
    fn the_integral_does_not_wind_up_at_the_ceiling() {
        let mut c = RateController::new();
        for _ in 0..1000 {
            let t = c.update(1e6, 1.0, GAINS, 10.0, 1000.0);
            assert_eq!(t.rate, 1000.0);
        }
        let t = c.update(100.0, 1.0, GAINS, 10.0, 1000.0);
        assert!(t.rate < 1000.0, "wound up: {t:?}");
        assert!(t.integral <= 1000.0, "integral {}", t.integral);
    }

    #[test]
    fn the_derivative_reacts_to_change_and_reset_forgets() {
        let mut c = RateController::new();
        c.update(100.0, 1.0, (0.0, 0.0, 2.0), 0.0, 1e6);
        let t = c.update(300.0, 0.5, (0.0, 0.0, 2.0), 0.0, 1e6);
        assert_eq!(t.derivative, 800.0, "2 × 200 blocks / 0.5 s");
        c.reset();
        let t = c.update(300.0, 0.5, (0.0, 1.0, 2.0), 0.0, 1e6);
        assert_eq!((t.derivative, t.integral), (0.0, 150.0));
    }
}
