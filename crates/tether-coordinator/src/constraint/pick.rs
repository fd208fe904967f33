//! Drawing a constrained sequence's next token: the sampler's chain runs over the allowed
//! tokens only, so the token drawn is always one the grammar allows.
//!
//! From a row's top candidates when at least one of them is allowed (the draw is then
//! among the allowed tokens of the top candidates); when none is, the row's every logit is
//! needed ([`Picked::NeedLogits`]), and the draw is among every allowed token.

use tether_model::Sampler;

use super::{Constraint, ConstraintError};

/// The outcome of a draw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Picked {
    /// The token drawn.
    Token(u32),
    /// No candidate of the row is allowed: fetch the row's every logit and draw again.
    NeedLogits,
}

impl Constraint {
    /// Draws from a row's most likely `candidates` (highest first) the allowed ones only;
    /// `ends` tells the tokens that end the generation.
    pub(crate) fn pick_top(
        &mut self,
        sampler: &mut Sampler,
        candidates: &[(u32, f32)],
        history: &[u32],
        ends: &dyn Fn(u32) -> bool,
    ) -> Result<Picked, ConstraintError> {
        let next = self.allowed()?;
        let allowed: Vec<(u32, f32)> = candidates
            .iter()
            .copied()
            .filter(|c| next.has(c.0, ends(c.0)))
            .collect();
        let Some(&(best, _)) = allowed.first() else {
            return Ok(Picked::NeedLogits);
        };
        let token = sampler.sample_top(&allowed, history);
        // The chain draws from what it was given; should a bias ban every allowed token,
        // the most likely allowed one still keeps the output inside the grammar.
        Ok(Picked::Token(if allowed.iter().any(|c| c.0 == token) {
            token
        } else {
            best
        }))
    }

    /// The one token the grammar allows next, when it allows exactly one and may not end
    /// here (nor is that token one that `ends` the generation): any draw would give it.
    pub(crate) fn forced(
        &mut self,
        ends: &dyn Fn(u32) -> bool,
    ) -> Result<Option<u32>, ConstraintError> {
        let next = self.allowed()?;
        Ok(next.single().filter(|&t| !ends(t)))
    }

    /// Draws from a row's every logit, the tokens the grammar does not allow set to
    /// `-inf`. `None` when the grammar allows no token at all.
    pub(crate) fn pick_full(
        &mut self,
        sampler: &mut Sampler,
        logits: &[f32],
        history: &[u32],
        ends: &dyn Fn(u32) -> bool,
    ) -> Result<Option<u32>, ConstraintError> {
        let next = self.allowed()?;
        let mut masked = Vec::with_capacity(logits.len());
        let mut best: Option<(u32, f32)> = None;
        for (id, &l) in (0u32..).zip(logits) {
            if next.has(id, ends(id)) {
                masked.push(l);
                if best.is_none_or(|b| l > b.1 || b.1.is_nan()) {
                    best = Some((id, l));
                }
            } else {
                masked.push(f32::NEG_INFINITY);
            }
        }
        let Some((best, _)) = best else {
            return Ok(None);
        };
        let token = sampler.sample(&masked, history);
        Ok(Some(if next.has(token, ends(token)) {
            token
        } else {
            best
        }))
    }
}
