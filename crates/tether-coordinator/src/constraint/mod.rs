//! Constrained decoding: a grammar (a JSON schema, or a Lark-like grammar) that the
//! generated text must stay inside. llguidance compiles the grammar for the model's
//! vocabulary and walks it a token at a time; a sequence's [`Constraint`] holds that walk,
//! and its sampler draws only among the tokens the grammar allows next ([`pick`]).

mod pick;
mod vocab;

pub(crate) use pick::Picked;

use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;
use tether_model::tokenizer::Tokenizer;
use toktrie::SimpleVob;

/// Why a grammar could not be used.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum ConstraintError {
    /// The request's grammar or schema is invalid or uses something not supported; the
    /// message says what.
    #[error("{0}")]
    Grammar(String),
    /// The model's vocabulary cannot carry grammars.
    #[error("{0}")]
    Vocabulary(String),
    /// The matcher failed while generating (a grammar past llguidance's limits).
    #[error("the grammar's matcher failed: {0}")]
    Matcher(String),
}

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// JSON that validates against this JSON schema (`{"type": "object"}` for any object).
    JsonSchema(Value),
    /// Text of this grammar, in llguidance's Lark-like syntax.
    Lark(String),
}

/// Where JSON output may have whitespace: one space after `:` and `,`, nowhere else. Free
/// whitespace would let a model pad forever without finishing the document.
pub fn json_layout() -> Value {
    serde_json::json!({
        "whitespace_flexible": false,
        "key_separator": ": ",
        "item_separator": ", ",
    })
}

/// The grammar compiler for one model's vocabulary (built once per model load).
pub struct Grammars {
    factory: ParserFactory,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars").finish_non_exhaustive()
    }
}

impl Grammars {
    /// The compiler for `tokenizer`'s vocabulary.
    pub fn for_tokenizer(tokenizer: &Tokenizer) -> Result<Grammars, ConstraintError> {
        let env = vocab::token_env(tokenizer)?;
        let mut factory = ParserFactory::new_simple(&env)
            .map_err(|e| ConstraintError::Vocabulary(format!("indexing the vocabulary: {e}")))?;
        factory.quiet();
        Ok(Grammars { factory })
    }

    /// A fresh walk of `spec`, or why it cannot be compiled (unsupported schema keywords
    /// are named).
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, ConstraintError> {
        let grammar = match spec {
            GrammarSpec::JsonSchema(schema) => {
                let mut schema = schema.clone();
                if let Some(fields) = schema.as_object_mut() {
                    fields.entry("x-guidance").or_insert_with(json_layout);
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| ConstraintError::Grammar(e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(ConstraintError::Grammar(e));
        }
        Ok(Constraint {
            matcher,
            next: None,
        })
    }
}

/// One sequence's walk through its grammar.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// The tokens allowed next and whether the grammar may end here, computed when first
    /// needed after each token.
    next: Option<(SimpleVob, bool)>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint")
            .field("stopped", &self.matcher.is_stopped())
            .finish_non_exhaustive()
    }
}

impl Constraint {
    /// The allowed tokens and whether the grammar may end now.
    fn next(&mut self) -> Result<&(SimpleVob, bool), ConstraintError> {
        let next = match self.next.take() {
            Some(next) => next,
            None => {
                let mask = self
                    .matcher
                    .compute_mask()
                    .map_err(|e| ConstraintError::Matcher(e.to_string()))?;
                let accepting = self
                    .matcher
                    .is_accepting()
                    .map_err(|e| ConstraintError::Matcher(e.to_string()))?;
                (mask, accepting)
            }
        };
        Ok(self.next.insert(next))
    }

    /// Computes the tokens allowed next now, so that the draw finds them ready; whether
    /// there was anything to compute. A failure is left for the draw to report.
    pub fn prepare(&mut self) -> bool {
        let fresh = self.next.is_none();
        if fresh {
            let _ = self.next();
        }
        fresh
    }

    /// Whether the tokens allowed next are computed.
    pub fn is_prepared(&self) -> bool {
        self.next.is_some()
    }

    /// The tokens that may come next.
    pub(crate) fn allowed(&mut self) -> Result<Allowed<'_>, ConstraintError> {
        let (mask, accepting) = self.next()?;
        Ok(Allowed {
            mask,
            accepting: *accepting,
        })
    }

    /// Moves past `token` (which [`Constraint::allowed`] has); returns whether the grammar is
    /// complete and allows nothing more.
    pub fn advance(&mut self, token: u32) -> Result<bool, ConstraintError> {
        self.next = None;
        self.matcher
            .consume_token(token)
            .map_err(|e| ConstraintError::Matcher(e.to_string()))?;
        Ok(self.matcher.is_stopped())
    }
}

/// The tokens a grammar allows next.
pub(crate) struct Allowed<'a> {
    mask: &'a SimpleVob,
    accepting: bool,
}

impl Allowed<'_> {
    /// Whether `token` may come next; `ends` says whether it would end the generation (an
    /// end-of-generation or stop token), which is allowed exactly when the grammar may end
    /// here.
    pub(crate) fn has(&self, token: u32, ends: bool) -> bool {
        if ends {
            self.accepting
        } else {
            self.mask.is_allowed(token)
        }
    }

    /// The only token allowed, when the grammar may not end here and allows exactly one.
    pub(crate) fn single(&self) -> Option<u32> {
        if self.accepting || self.mask.num_set() != 1 {
            return None;
        }
        self.mask.first_bit_set().map(|t| t as u32)
    }
}

#[cfg(test)]
mod tests;
