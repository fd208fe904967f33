//! The prompts `bench --serve` sends: random token ids or random words, different in every
//! request (so the prefix cache cannot skip work the figures should include) unless a
//! shared prefix is asked for.

/// xorshift64*: small and seedable; prompts only need to differ, not to be good random.
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator for stream `stream` of run `seed` (seeded through splitmix64, so that
    /// nearby streams give unrelated prompts).
    pub(crate) fn new(seed: u64, stream: u64) -> Rng {
        Rng(tether_compute::rng::SplitMix64::seed_of(seed, stream) | 1)
    }

    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Common words: each is one or two tokens in most vocabularies.
const WORDS: [&str; 48] = [
    "the", "river", "stone", "light", "green", "after", "house", "small", "water", "under",
    "quiet", "north", "paper", "glass", "eight", "story", "table", "winter", "field", "never",
    "music", "horse", "bread", "cloud", "silver", "market", "garden", "window", "ocean", "forest",
    "orange", "simple", "number", "little", "letter", "mountain", "people", "question", "friend",
    "morning", "city", "road", "fire", "dream", "voice", "street", "summer", "engine",
];

/// Random words, separated by spaces.
pub(crate) fn words(rng: &mut Rng, n: usize) -> String {
    let mut out = String::new();
    for i in 0..n {
        if i > 0 {
            out.push(' ');
        }
        out.push_str(WORDS[rng.below(WORDS.len() as u64) as usize]);
    }
    out
}

/// What one request's prompt is made of.
#[derive(Clone, Copy, Debug)]
pub(crate) struct PromptShape {
    /// Prompt length: token ids, or words with `words`.
    pub(crate) len: usize,
    /// Leading part that is the same in every request.
    pub(crate) shared: usize,
    /// Words instead of token ids.
    pub(crate) words: bool,
    /// Token ids are drawn from 1..id_limit (0 is often padding).
    pub(crate) id_limit: u32,
}

/// A completion prompt: a JSON array of ids or a string.
pub(crate) fn completion_prompt(shape: PromptShape, seed: u64, request: u64) -> serde_json::Value {
    // Stream 0 is the shared prefix; every request has a stream of its own after it.
    let mut shared = Rng::new(seed, 0);
    let mut own = Rng::new(seed, request + 1);
    let unshared = shape.len - shape.shared;
    if shape.words {
        let head = words(&mut shared, shape.shared);
        let tail = words(&mut own, unshared);
        return match (head.is_empty(), tail.is_empty()) {
            (true, _) => tail.into(),
            (_, true) => head.into(),
            _ => format!("{head} {tail}").into(),
        };
    }
    let limit = u64::from(shape.id_limit.max(2)) - 1;
    let ids: Vec<u32> = (0..shape.shared)
        .map(|_| 1 + shared.below(limit) as u32)
        .chain((0..unshared).map(|_| 1 + own.below(limit) as u32))
        .collect();
    ids.into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(len: usize, shared: usize, words: bool) -> PromptShape {
        PromptShape {
            len,
            shared,
            words,
            id_limit: 320,
        }
    }

    #[test]
    fn requests_differ_unless_a_prefix_is_shared() {
        let a = completion_prompt(shape(64, 0, false), 7, 0);
        let b = completion_prompt(shape(64, 0, false), 7, 1);
        assert_eq!(a.as_array().map(Vec::len), Some(64));
        assert_ne!(a, b);
        let (a, b) = (
            completion_prompt(shape(64, 40, false), 7, 0),
            completion_prompt(shape(64, 40, false), 7, 1),
        );
        let (a, b) = (a.as_array().expect("ids"), b.as_array().expect("ids"));
        assert_eq!(a[..40], b[..40]);
        assert_ne!(a[40..], b[40..]);
        assert!(
            a.iter()
                .all(|id| (1..320).contains(&id.as_u64().unwrap_or(0)))
        );
    }

    #[test]
    fn word_prompts_have_the_asked_number_of_words() {
        let p = completion_prompt(shape(10, 4, true), 3, 5);
        let q = completion_prompt(shape(10, 4, true), 3, 6);
        let (p, q) = (p.as_str().expect("text"), q.as_str().expect("text"));
        assert_eq!(p.split(' ').count(), 10);
        fn head(s: &str) -> Vec<&str> {
            s.split(' ').take(4).collect()
        }
        assert_eq!(head(p), head(q));
        assert_ne!(p, q);
    }
}
