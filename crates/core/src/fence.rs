//! Safety rule 2, the resource side: admit a fencing token iff it is at least the highest seen.

/// A token was older than one the resource has already seen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("stale fencing token {token}: this resource has already seen token {highest}")]
pub struct StaleToken {
    /// The token that was presented.
    pub token: u64,
    /// The highest token admitted so far.
    pub highest: u64,
}

/// Tracks the highest fencing token a resource has admitted.
///
/// Call [`Fence::admit`] in the same critical section (lock, transaction) as the write it protects:
/// checking first and writing later would let a stale holder slip in between.
///
/// ```
/// # use baton_core::Fence;
/// // `baton::Fence` in the `baton` crate.
/// let mut fence = Fence::new();
/// assert!(fence.admit(7).is_ok());
/// assert!(fence.admit(7).is_ok()); // the same leader may write again
/// let stale = fence.admit(5).unwrap_err();
/// assert_eq!((stale.token, stale.highest), (5, 7));
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fence {
    highest: Option<u64>,
}

impl Fence {
    /// A fence that has seen no token.
    pub fn new() -> Fence {
        Fence { highest: None }
    }

    /// A fence restored from a persisted highest token.
    pub fn with_highest(highest: u64) -> Fence {
        Fence {
            highest: Some(highest),
        }
    }

    /// The highest token admitted so far.
    pub fn highest(&self) -> Option<u64> {
        self.highest
    }

    /// Whether `token` would be admitted, without recording it.
    pub fn check(&self, token: u64) -> Result<(), StaleToken> {
        match self.highest {
            Some(highest) if token < highest => Err(StaleToken { token, highest }),
            _ => Ok(()),
        }
    }

    /// Admits `token` iff it is ≥ the highest seen, and records it.
    pub fn admit(&mut self, token: u64) -> Result<(), StaleToken> {
        self.check(token)?;
        self.highest = Some(token);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        /// Property: a token is admitted iff it is ≥ every token admitted before it, and the
        /// recorded highest is the maximum of the admitted tokens.
        #[test]
        fn admits_exactly_the_non_decreasing_tokens(tokens in proptest::collection::vec(0u64..50, 0..64)) {
            let mut fence = Fence::new();
            let mut admitted: Vec<u64> = Vec::new();
            for token in tokens {
                let expected_ok = admitted.iter().all(|&seen| token >= seen);
                match fence.admit(token) {
                    Ok(()) => { prop_assert!(expected_ok); admitted.push(token); }
                    Err(stale) => {
                        prop_assert!(!expected_ok);
                        prop_assert_eq!(stale.token, token);
                        prop_assert_eq!(Some(stale.highest), admitted.iter().copied().max());
                    }
                }
                prop_assert_eq!(fence.highest(), admitted.iter().copied().max());
            }
            // The admitted sequence never decreases.
            prop_assert!(admitted.windows(2).all(|w| w[0] <= w[1]));
        }

        /// Property: `check` agrees with `admit` and never changes state.
        #[test]
        fn check_is_pure(highest in 0u64..100, token in 0u64..100) {
            let fence = Fence::with_highest(highest);
            let before = fence.clone();
            let checked = fence.check(token);
            prop_assert_eq!(&fence, &before);
            let mut admitting = fence.clone();
            prop_assert_eq!(checked, admitting.admit(token));
        }
    }

    #[test]
    fn stale_error_names_both_tokens() {
        let mut fence = Fence::with_highest(12);
        let message = fence.admit(3).unwrap_err().to_string();
        assert_eq!(
            message,
            "stale fencing token 3: this resource has already seen token 12"
        );
    }
}
