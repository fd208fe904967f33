//! SplitMix64, the one small seeded generator of the project: the sampler's random draws,
//! the test data of the backends, and the seeding of other generators in the binaries and
//! their tests. It lives here, the lowest crate all of them share.

/// SplitMix64: a small, fast generator whose whole state is one `u64`.
#[derive(Clone, Debug)]
pub struct SplitMix64(u64);

/// The increment of each step (2^64 / φ, odd).
const GOLDEN: u64 = 0x9E37_79B9_7F4A_7C15;

impl SplitMix64 {
    /// A generator starting from `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        Self::step(&mut self.0)
    }

    /// A uniform value in `[0, 1)`.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// One step of the generator whose state is `state`: for generators kept as a bare
    /// `u64` (test helpers whose state is a public field).
    pub fn step(state: &mut u64) -> u64 {
        *state = state.wrapping_add(GOLDEN);
        let mut z = *state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// The first output of stream `stream` of seed `seed`: spreads nearby seeds and streams
    /// into unrelated 64-bit values, to seed another generator with.
    pub fn seed_of(seed: u64, stream: u64) -> u64 {
        Self::new(seed.wrapping_add(stream.wrapping_mul(GOLDEN))).next_u64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_the_reference_sequence() {
        // The first outputs of splitmix64 seeded with 0, as its author's C code gives them.
        let mut g = SplitMix64::new(0);
        assert_eq!(g.next_u64(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(g.next_u64(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(SplitMix64::seed_of(0, 0), 0xE220_A839_7B1D_CDAF);
        assert_ne!(SplitMix64::seed_of(0, 1), SplitMix64::seed_of(1, 0));
    }
}
