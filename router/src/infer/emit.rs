//! The one way a token reaches its request (`Output::emit`), sampled by a step or forced
//! by the request's grammar: counted in the metrics (and its tenant's account), turned
//! into its event by the request's `Entry`, its end recorded, and sent to its handler.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use super::entry::Entry;
use super::events::Token;
use crate::blocks::RequestId;
use crate::detokenize::TokenizerInfo;
use crate::metrics::Metrics;
use crate::pb;

/// A token on its way to its request: sampled by a step (with its logprob and the
/// alternatives asked for), or forced by the request's grammar.
pub(super) struct NextToken {
    pub id: u32,
    pub sampled: Option<(Option<f32>, Vec<Token>)>,
}

/// What every emitted token needs besides its request.
pub(super) struct Output {
    pub tokenizer: TokenizerInfo,
    pub eos: HashSet<u32>,
    pub metrics: Arc<Metrics>,
}

impl Output {
    /// The one way a token reaches its request: counted, turned into its event (text,
    /// end), and sent. `generated` counts it; `prompt` (the prompt's tokens with their
    /// logprobs and alternatives) rides along with a request's first event when asked.
    /// True when it ended the request.
    pub(super) fn emit(
        &self,
        entry: &mut Entry,
        id: RequestId,
        token: NextToken,
        generated: usize,
        prompt: Option<(Vec<Token>, Vec<Vec<Token>>)>,
    ) -> bool {
        let m = &self.metrics;
        let forced = token.sampled.is_none();
        let (logprob, top_tokens) = match token.sampled {
            Some((logprob, top_tokens)) => {
                let now = Instant::now();
                match entry.last_token_at {
                    Some(last) => m.itl.observe((now - last).as_secs_f64()),
                    None => m.ttft.observe((now - entry.queued_at).as_secs_f64()),
                }
                entry.last_token_at = Some(now);
                (logprob, top_tokens)
            }
            None => (None, Vec::new()),
        };
        m.generation_tokens.add(1);
        if let Some(tenant) = entry.tenant() {
            tenant.add_generated_token();
        }
        if forced {
            m.fast_forward_tokens.add(1);
        }
        let mut event = entry.on_token(
            &self.tokenizer,
            &self.eos,
            token.id,
            generated,
            logprob,
            top_tokens,
        );
        if let Some((prefill, prefill_top_tokens)) = prompt {
            event.prefill = prefill;
            event.prefill_top_tokens = prefill_top_tokens;
        }
        match &event.end {
            Some(end) => {
                entry.record_end(m, id, end);
                entry.send_last(Ok(event));
                true
            }
            None => {
                let _ = entry.events.send(Ok(event));
                false
            }
        }
    }

    /// The prompt's tokens with their logprobs (the first has none) and, with
    /// top_n_tokens, the alternatives to each but the first.
    pub(super) fn prompt_tokens(
        &self,
        prompt: &[u32],
        generation: &pb::Generation,
    ) -> (Vec<Token>, Vec<Vec<Token>>) {
        let tokens = prompt
            .iter()
            .enumerate()
            .map(|(i, &id)| Token {
                id,
                text: self.tokenizer.token_text(id),
                logprob: i
                    .checked_sub(1)
                    .and_then(|j| generation.prompt_logprobs.get(j).copied()),
                special: self.tokenizer.is_special(id),
            })
            .collect();
        let top = generation
            .prompt_top_tokens
            .iter()
            .map(|top| self.top_tokens(top))
            .collect();
        (tokens, top)
    }

    /// A position's most likely tokens, as the shard reported them.
    /// Token `id` with its logprob, as a handler receives it.
    pub(super) fn token(&self, id: u32, logprob: f32) -> Token {
        Token {
            id,
            text: self.tokenizer.token_text(id),
            logprob: Some(logprob),
            special: self.tokenizer.is_special(id),
        }
    }

    pub(super) fn top_tokens(&self, top: &pb::TopTokens) -> Vec<Token> {
        top.ids
            .iter()
            .zip(&top.logprobs)
            .map(|(&id, &logprob)| Token {
                id,
                text: self.tokenizer.token_text(id),
                logprob: Some(logprob),
                special: self.tokenizer.is_special(id),
            })
            .collect()
    }
}
