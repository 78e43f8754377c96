//! One request's place in its grammar, kept by the batching loop beside its tokens: the
//! tokens it may sample next (as the packed mask the Step carries), the tokens it
//! sampled, and the tokens the grammar forces next (fast-forward).

use std::sync::Arc;

use llguidance::Matcher;
use toktrie::SimpleVob;

use super::compiler::Compiled;

/// What the loop needs about the model's vocabulary to build masks.
#[derive(Debug, Clone)]
pub struct MaskShape {
    /// Rows of the model's logits; the mask covers them all.
    pub logits_width: usize,
    /// Every end-of-sequence id: all are allowed whenever the grammar may end.
    pub eos: Arc<[u32]>,
}

impl MaskShape {
    /// A mask allowing nothing, as words of 32 bits.
    pub fn none(&self) -> Vec<u32> {
        vec![0; self.logits_width.div_ceil(32)]
    }

    /// Allows every EOS id in `words`.
    pub fn allow_eos(&self, words: &mut [u32]) {
        for &eos in self
            .eos
            .iter()
            .filter(|&&e| (e as usize) < self.logits_width)
        {
            words[eos as usize / 32] |= 1 << (eos % 32);
        }
    }
}

pub struct GrammarState {
    matcher: Matcher,
    pub field: Arc<str>,
}

impl GrammarState {
    pub fn new(compiled: &Compiled) -> Self {
        Self {
            matcher: compiled.start(),
            field: compiled.field.clone(),
        }
    }

    fn error(&self, what: &str, e: impl std::fmt::Display) -> String {
        format!("{}: the grammar failed {what}: {e}", self.field)
    }

    /// The tokens allowed at the next sampled position, as words of 32 bits (bit t % 32
    /// of word t / 32). Every EOS id is allowed when the grammar may end there, and only
    /// EOS once it has ended.
    pub fn allowed(&mut self, shape: &MaskShape) -> Result<Vec<u32>, String> {
        let mut words = shape.none();
        let ended = self.matcher.is_stopped();
        if !ended {
            let mask: SimpleVob = self
                .matcher
                .compute_mask()
                .map_err(|e| self.error("computing the next tokens", e))?;
            let bits = mask.as_slice();
            let n = bits.len().min(words.len());
            words[..n].copy_from_slice(&bits[..n]);
        }
        if ended || self.matcher.is_accepting().unwrap_or(false) {
            shape.allow_eos(&mut words);
        }
        if words.iter().all(|&w| w == 0) {
            return Err(format!(
                "{}: the grammar allows no token here (the output cannot be completed)",
                self.field
            ));
        }
        Ok(words)
    }

    /// Moves past a sampled (or forced) token. EOS is never fed: it ends the request, or,
    /// with `ignore_eos`, the grammar has already ended.
    pub fn commit(&mut self, token: u32) -> Result<(), String> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher
            .consume_token(token)
            .map_err(|e| self.error(&format!("on token {token}"), e))
    }

    /// The tokens the grammar forces from here, in its canonical tokenization, consumed:
    /// the caller appends them without sampling. At most `limit`.
    pub fn fast_forward(&mut self, limit: usize) -> Vec<u32> {
        if limit == 0 || self.matcher.is_stopped() {
            return Vec::new();
        }
        let mut forced = self.matcher.compute_ff_tokens();
        forced.truncate(limit);
        if forced.is_empty() || self.matcher.consume_tokens(&forced).is_err() {
            return Vec::new();
        }
        forced
    }

    /// Whether the grammar has reached its end (nothing but EOS may follow).
    pub fn ended(&self) -> bool {
        self.matcher.is_stopped()
    }
}

impl Clone for GrammarState {
    /// An independent copy at the same position (a sibling sample forks from it).
    fn clone(&self) -> Self {
        Self {
            matcher: self.matcher.deep_clone(),
            field: self.field.clone(),
        }
    }
}
