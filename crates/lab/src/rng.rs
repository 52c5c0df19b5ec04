//! The simulator's only source of randomness: a small seeded generator.
//!
//! The lab writes its own generator (xoshiro256**, seeded through SplitMix64) rather than
//! depending on a crate, because "the same seed gives byte-identical output" must survive
//! dependency upgrades: a library is free to change its algorithms between versions.

/// A seeded xoshiro256** generator.
#[derive(Debug, Clone)]
pub struct Rng {
    state: [u64; 4],
}

/// One step of SplitMix64, used to expand a seed into generator state.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

impl Rng {
    /// A generator whose whole future is fixed by `seed`.
    pub fn new(seed: u64) -> Rng {
        let mut expand = seed;
        let state = [
            splitmix64(&mut expand),
            splitmix64(&mut expand),
            splitmix64(&mut expand),
            splitmix64(&mut expand),
        ];
        Rng { state }
    }

    /// An independent generator derived from this one (for a sub-stream such as the scenario).
    pub fn fork(&mut self) -> Rng {
        Rng::new(self.next_u64())
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let [s0, s1, s2, s3] = &mut self.state;
        let result = s1.wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = *s1 << 17;
        *s2 ^= *s0;
        *s3 ^= *s1;
        *s1 ^= *s2;
        *s0 ^= *s3;
        *s2 ^= t;
        *s3 = s3.rotate_left(45);
        result
    }

    /// A number in `0..bound` (0 when `bound` is 0), by multiply-shift.
    pub fn below(&mut self, bound: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(bound)) >> 64) as u64
    }

    /// A number in `low..=high`.
    pub fn between(&mut self, low: u64, high: u64) -> u64 {
        if high <= low {
            return low;
        }
        low + self.below(high - low + 1)
    }

    /// True with probability `ppm` parts per million.
    pub fn chance_ppm(&mut self, ppm: u32) -> bool {
        ppm > 0 && self.below(1_000_000) < u64::from(ppm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_bounds_hold() {
        let mut a = Rng::new(7);
        let mut b = Rng::new(7);
        for _ in 0..1000 {
            assert_eq!(a.next_u64(), b.next_u64());
        }
        let mut c = Rng::new(8);
        assert_ne!(Rng::new(7).next_u64(), c.next_u64());
        for _ in 0..1000 {
            assert!(a.below(10) < 10);
            let x = a.between(5, 9);
            assert!((5..=9).contains(&x));
        }
        assert_eq!(a.below(0), 0);
        assert_eq!(a.between(3, 3), 3);
        assert!(!a.chance_ppm(0));
        assert!(a.chance_ppm(1_000_000));
    }

    #[test]
    fn stream_is_pinned() {
        // Pinned values: changing the generator changes every recorded seed's trace, so it
        // must be a deliberate act.
        let mut rng = Rng::new(0);
        assert_eq!(rng.next_u64(), PINNED);
    }

    const PINNED: u64 = 11_091_344_671_253_066_420;
}
