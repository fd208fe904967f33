//! When a generation ends. The single-process [`Generator`](crate::Generator) and the
//! coordinator's sequences both follow these rules, so a request served over workers ends
//! at the same token, for the same reason, as one generated in one process.

/// Why a generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// An end-of-generation token was sampled (it is not passed on).
    EndOfGeneration,
    /// `max_tokens` tokens were produced.
    Limit,
    /// The context is full.
    ContextFull,
    /// The callback asked to stop.
    Callback,
}

/// The limits of one generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StopRules {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Cells of the sequence's context.
    pub ctx: usize,
}

/// What a sampled token does to its generation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// An end-of-generation token: the generation ends without it.
    Discard,
    /// Keep the token and go on.
    Keep,
    /// Keep the token (it is passed on), then end for this reason.
    KeepAndEnd(StopReason),
}

impl StopRules {
    /// Whether a generation ends before its first token (`max_tokens` of 0).
    pub fn before_first(&self) -> Option<StopReason> {
        (self.max_tokens == 0).then_some(StopReason::Limit)
    }

    /// What a sampled token does to a generation that has produced `generated` tokens and
    /// holds `history` tokens (prompt and generated, less any dropped) before it.
    /// `max_tokens` wins over a full context: a caller that could make room must not.
    pub fn on_sampled(&self, is_eog: bool, generated: usize, history: usize) -> Verdict {
        if is_eog {
            return Verdict::Discard;
        }
        if generated + 1 >= self.max_tokens {
            return Verdict::KeepAndEnd(StopReason::Limit);
        }
        // Going on feeds the token at position `history`, which must be a cell of the
        // context; a token sampled from the last cell's logits is still kept.
        if history + 1 > self.ctx {
            return Verdict::KeepAndEnd(StopReason::ContextFull);
        }
        Verdict::Keep
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_end_token_is_discarded_whatever_the_limits() {
        let rules = StopRules {
            max_tokens: 1,
            ctx: 1,
        };
        assert_eq!(rules.on_sampled(true, 0, 5), Verdict::Discard);
    }

    #[test]
    fn max_tokens_wins_over_a_full_context() {
        let rules = StopRules {
            max_tokens: 3,
            ctx: 8,
        };
        assert_eq!(rules.on_sampled(false, 1, 5), Verdict::Keep);
        let limit = Verdict::KeepAndEnd(StopReason::Limit);
        assert_eq!(rules.on_sampled(false, 2, 5), limit);
        assert_eq!(rules.on_sampled(false, 2, 8), limit);
        assert_eq!(
            rules.on_sampled(false, 1, 8),
            Verdict::KeepAndEnd(StopReason::ContextFull)
        );
        assert_eq!(rules.on_sampled(false, 1, 7), Verdict::Keep);
    }

    #[test]
    fn zero_max_tokens_ends_before_the_first() {
        let rules = StopRules {
            max_tokens: 0,
            ctx: 8,
        };
        assert_eq!(rules.before_first(), Some(StopReason::Limit));
        let rules = StopRules {
            max_tokens: 1,
            ctx: 8,
        };
        assert_eq!(rules.before_first(), None);
    }
}
