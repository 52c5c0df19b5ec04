//! Election configuration and its validation.

use std::time::Duration;

use crate::duration::format_duration;

/// One part in a million: the unit of [`ElectionConfig::max_drift_ppm`].
const PPM: u128 = 1_000_000;

/// How a candidate campaigns and how cautiously a leader measures its lease.
///
/// Build one with [`ElectionConfig::default`] and the `with_*` methods, then call
/// [`ElectionConfig::validate`] with the backend's minimum TTL before using it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ElectionConfig {
    /// Lease TTL requested from the server. A crashed leader blocks the election for this long.
    pub ttl: Duration,
    /// Time between renewals; `None` means a third of the TTL, which leaves room for two
    /// failed renewals before the local deadline.
    pub renew_interval: Option<Duration>,
    /// Assumed bound on how much faster the server's clock may run than ours, in parts per
    /// million. The local deadline shrinks the TTL by this fraction (safety rule 1).
    pub max_drift_ppm: u32,
    /// Extra time taken off the local deadline, to cover the gap between the deadline timer
    /// firing and the protected work actually stopping (scheduling, signal delivery).
    pub safety_margin: Duration,
    /// After losing leadership (not after resigning), campaign again automatically.
    pub requeue: bool,
}

impl Default for ElectionConfig {
    fn default() -> ElectionConfig {
        ElectionConfig {
            ttl: Duration::from_secs(10),
            renew_interval: None,
            max_drift_ppm: 10_000,
            safety_margin: Duration::from_millis(100),
            requeue: false,
        }
    }
}

/// What a backend can hold: [`ElectionConfig::validate`] checks a configuration against it, so
/// that a configuration it accepts is one the backend accepts too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackendLimits {
    /// The shortest lease TTL.
    pub min_ttl: Duration,
    /// The longest lease TTL.
    pub max_ttl: Duration,
    /// TTLs must be whole multiples of this (zero: any TTL).
    pub ttl_step: Duration,
}

impl BackendLimits {
    /// No limits beyond a TTL above zero.
    pub const NONE: BackendLimits = BackendLimits {
        min_ttl: Duration::ZERO,
        max_ttl: Duration::MAX,
        ttl_step: Duration::ZERO,
    };
}

/// The shortest renew interval accepted: anything shorter is a request storm.
pub const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(1);

/// Why an [`ElectionConfig`] was rejected.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A TTL of zero would make every leadership end before it starts.
    #[error("ttl must be greater than zero")]
    TtlZero,
    /// The backend cannot hold a lease this short.
    #[error("ttl {ttl} is below this backend's minimum of {minimum}")]
    TtlBelowMinimum {
        /// The requested TTL, formatted.
        ttl: String,
        /// The backend's minimum, formatted.
        minimum: String,
    },
    /// The backend cannot hold a lease this long.
    #[error("ttl {ttl} is above this backend's maximum of {maximum}")]
    TtlAboveMaximum {
        /// The requested TTL, formatted.
        ttl: String,
        /// The backend's maximum, formatted.
        maximum: String,
    },
    /// The backend's leases come in whole steps (etcd: seconds).
    #[error("ttl {ttl} is not a whole multiple of {step} (this backend's leases come in steps of {step})")]
    TtlNotMultiple {
        /// The requested TTL, formatted.
        ttl: String,
        /// The backend's step, formatted.
        step: String,
    },
    /// A drift bound of 50% or more leaves no meaningful lease.
    #[error("max drift {ppm} ppm is not below 500000 ppm (50%)")]
    DriftTooLarge {
        /// The requested bound.
        ppm: u32,
    },
    /// Drift and margin together consume the whole TTL.
    #[error("safety margin {margin} leaves no time to lead within ttl {ttl}")]
    MarginTooLarge {
        /// The margin, formatted.
        margin: String,
        /// The TTL, formatted.
        ttl: String,
    },
    /// Drift and margin leave less time to lead than the default renew interval (a third of
    /// the TTL), so no leadership could outlive its first renewal.
    #[error("safety margin {margin} leaves {left} to lead within ttl {ttl}, less than the renew interval {renew} (a third of the ttl): lower the safety margin or raise the ttl")]
    MarginLeavesTooLittle {
        /// The margin, formatted.
        margin: String,
        /// The local lease span left, formatted.
        left: String,
        /// The TTL, formatted.
        ttl: String,
        /// The default renew interval, formatted.
        renew: String,
    },
    /// A zero renew interval would spin.
    #[error("renew interval must be greater than zero")]
    RenewZero,
    /// Renewals this frequent are a storm of requests, not a lease.
    #[error("renew interval {renew} is below the minimum of 1ms")]
    RenewTooFast {
        /// The requested interval, formatted.
        renew: String,
    },
    /// Renewals would come after the local deadline, so every leadership would be lost.
    #[error("renew interval {renew} is not shorter than the local deadline {deadline} (ttl {ttl} less drift and margin)")]
    RenewTooSlow {
        /// The renew interval, formatted.
        renew: String,
        /// The local lease span, formatted.
        deadline: String,
        /// The TTL, formatted.
        ttl: String,
    },
}

impl ElectionConfig {
    /// Sets the TTL.
    pub fn with_ttl(mut self, ttl: Duration) -> ElectionConfig {
        self.ttl = ttl;
        self
    }

    /// Sets the renew interval.
    pub fn with_renew_interval(mut self, interval: Duration) -> ElectionConfig {
        self.renew_interval = Some(interval);
        self
    }

    /// Sets the drift bound in parts per million.
    pub fn with_max_drift_ppm(mut self, ppm: u32) -> ElectionConfig {
        self.max_drift_ppm = ppm;
        self
    }

    /// Sets the safety margin.
    pub fn with_safety_margin(mut self, margin: Duration) -> ElectionConfig {
        self.safety_margin = margin;
        self
    }

    /// Sets requeue.
    pub fn with_requeue(mut self, requeue: bool) -> ElectionConfig {
        self.requeue = requeue;
        self
    }

    /// The effective renew interval.
    pub fn renew_interval(&self) -> Duration {
        self.renew_interval.unwrap_or(self.ttl / 3)
    }

    /// How long after the *send* time of an acknowledged grant or renewal a holder may keep
    /// acting, for a lease the server granted with `granted_ttl`: the TTL shrunk by the drift
    /// bound, less the safety margin. Zero when nothing is left.
    pub fn local_lease(&self, granted_ttl: Duration) -> Duration {
        let ttl_nanos = granted_ttl.as_nanos();
        let drift_nanos = (ttl_nanos * u128::from(self.max_drift_ppm)).div_ceil(PPM);
        let shrunk = ttl_nanos.saturating_sub(drift_nanos);
        let local = shrunk.saturating_sub(self.safety_margin.as_nanos());
        Duration::from_nanos(u64::try_from(local).unwrap_or(u64::MAX))
    }

    /// Checks the configuration against itself and the backend's minimum TTL.
    pub fn validate(&self, limits: &BackendLimits) -> Result<(), ConfigError> {
        if self.ttl.is_zero() {
            return Err(ConfigError::TtlZero);
        }
        if self.ttl < limits.min_ttl {
            return Err(ConfigError::TtlBelowMinimum {
                ttl: format_duration(self.ttl),
                minimum: format_duration(limits.min_ttl),
            });
        }
        if self.ttl > limits.max_ttl {
            return Err(ConfigError::TtlAboveMaximum {
                ttl: format_duration(self.ttl),
                maximum: format_duration(limits.max_ttl),
            });
        }
        if !limits.ttl_step.is_zero() && self.ttl.as_nanos() % limits.ttl_step.as_nanos() != 0 {
            return Err(ConfigError::TtlNotMultiple {
                ttl: format_duration(self.ttl),
                step: format_duration(limits.ttl_step),
            });
        }
        if self.max_drift_ppm >= 500_000 {
            return Err(ConfigError::DriftTooLarge {
                ppm: self.max_drift_ppm,
            });
        }
        let local = self.local_lease(self.ttl);
        if local.is_zero() {
            return Err(ConfigError::MarginTooLarge {
                margin: format_duration(self.safety_margin),
                ttl: format_duration(self.ttl),
            });
        }
        let renew = self.renew_interval();
        if renew.is_zero() {
            return Err(ConfigError::RenewZero);
        }
        if renew < MIN_RENEW_INTERVAL {
            return Err(ConfigError::RenewTooFast {
                renew: format_duration(renew),
            });
        }
        if renew >= local && self.renew_interval.is_none() {
            // The user set no renew interval: the margin (or drift) is what leaves too little.
            return Err(ConfigError::MarginLeavesTooLittle {
                margin: format_duration(self.safety_margin),
                left: readable(local),
                ttl: format_duration(self.ttl),
                renew: readable(renew),
            });
        }
        if renew >= local {
            return Err(ConfigError::RenewTooSlow {
                renew: readable(renew),
                deadline: readable(local),
                ttl: format_duration(self.ttl),
            });
        }
        Ok(())
    }
}

/// A duration for a message: exact when it is a whole number of some unit, else in
/// milliseconds to three decimals ("666.667ms", not "666666666ns").
fn readable(duration: Duration) -> String {
    let exact = format_duration(duration);
    if exact.ends_with("ns") && duration >= Duration::from_millis(1) {
        format!("{:.3}ms", duration.as_secs_f64() * 1000.0)
    } else {
        exact
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn min(min_ttl: Duration) -> BackendLimits {
        BackendLimits {
            min_ttl,
            ..BackendLimits::NONE
        }
    }

    #[test]
    fn local_lease_shrinks_by_drift_then_margin() {
        let config = ElectionConfig::default()
            .with_ttl(ms(2000))
            .with_max_drift_ppm(10_000)
            .with_safety_margin(ms(100));
        // 2000 ms less 1% (20 ms) less 100 ms.
        assert_eq!(config.local_lease(ms(2000)), ms(1880));
        // The granted TTL, not the requested one, is what counts.
        assert_eq!(config.local_lease(ms(5000)), ms(4850));
        // Drift rounds up (against the holder): 1 ppm of 1 ns is a whole nanosecond.
        let tiny = ElectionConfig::default()
            .with_max_drift_ppm(1)
            .with_safety_margin(Duration::ZERO);
        assert_eq!(tiny.local_lease(Duration::from_nanos(1)), Duration::ZERO);
        // Nothing left saturates at zero.
        assert_eq!(config.local_lease(ms(50)), Duration::ZERO);
    }

    #[test]
    fn default_is_valid_and_renews_at_a_third() {
        let config = ElectionConfig::default();
        assert_eq!(config.validate(&min(Duration::from_secs(1))), Ok(()));
        assert_eq!(
            config.renew_interval(),
            Duration::from_millis(3333) + Duration::from_nanos(333_333)
        );
    }

    #[test]
    fn validate_rejects_nonsense() {
        let base = ElectionConfig::default().with_ttl(ms(2000));
        assert_eq!(
            base.clone().with_ttl(Duration::ZERO).validate(&min(ms(1))),
            Err(ConfigError::TtlZero)
        );
        assert_eq!(
            base.clone().with_ttl(ms(500)).validate(&min(ms(1000))),
            Err(ConfigError::TtlBelowMinimum {
                ttl: "500ms".into(),
                minimum: "1s".into()
            })
        );
        assert_eq!(
            base.clone()
                .with_max_drift_ppm(500_000)
                .validate(&min(ms(1))),
            Err(ConfigError::DriftTooLarge { ppm: 500_000 })
        );
        assert!(base
            .clone()
            .with_max_drift_ppm(499_999)
            .validate(&min(ms(1)))
            .is_ok());
        assert_eq!(
            base.clone()
                .with_safety_margin(ms(1980))
                .validate(&min(ms(1))),
            Err(ConfigError::MarginTooLarge {
                margin: "1980ms".into(),
                ttl: "2s".into()
            })
        );
        assert_eq!(
            base.clone()
                .with_renew_interval(Duration::ZERO)
                .validate(&min(ms(1))),
            Err(ConfigError::RenewZero)
        );
        assert_eq!(
            base.clone()
                .with_renew_interval(Duration::from_nanos(1))
                .validate(&min(ms(1))),
            Err(ConfigError::RenewTooFast {
                renew: "1ns".into()
            })
        );
        assert_eq!(
            base.clone()
                .with_renew_interval(ms(1880))
                .validate(&min(ms(1))),
            Err(ConfigError::RenewTooSlow {
                renew: "1880ms".into(),
                deadline: "1880ms".into(),
                ttl: "2s".into()
            })
        );
        assert!(base
            .clone()
            .with_renew_interval(ms(1879))
            .validate(&min(ms(1)))
            .is_ok());
        // No renew interval given: the margin is named, with durations a person can read.
        let error = base
            .with_safety_margin(ms(1900))
            .validate(&min(ms(1)))
            .unwrap_err();
        assert_eq!(
            error,
            ConfigError::MarginLeavesTooLittle {
                margin: "1900ms".into(),
                left: "80ms".into(),
                ttl: "2s".into(),
                renew: "666.667ms".into(),
            }
        );
        assert!(error.to_string().contains("lower the safety margin"));
    }

    #[test]
    fn backend_limits_refuse_what_the_backend_would() {
        let etcd = BackendLimits {
            min_ttl: Duration::from_secs(1),
            max_ttl: Duration::from_secs(9_000_000_000),
            ttl_step: Duration::from_secs(1),
        };
        let config = ElectionConfig::default();
        assert_eq!(config.clone().with_ttl(ms(3000)).validate(&etcd), Ok(()));
        assert_eq!(
            config.clone().with_ttl(ms(2500)).validate(&etcd),
            Err(ConfigError::TtlNotMultiple {
                ttl: "2500ms".into(),
                step: "1s".into()
            })
        );
        assert!(matches!(
            config
                .with_ttl(Duration::from_secs(9_000_000_001))
                .validate(&etcd),
            Err(ConfigError::TtlAboveMaximum { .. })
        ));
    }
}
