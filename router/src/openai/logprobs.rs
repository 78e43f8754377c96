//! Logprobs in the two shapes OpenAI uses: the completions route's parallel lists
//! (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`) and the chat route's list
//! of per-token objects.

use std::collections::HashMap;

use serde::Serialize;
use utoipa::ToSchema;

use crate::detokenize::TokenizerInfo;
use crate::infer::Token;

/// A token as logprobs show it: its own text, special tokens included.
fn token_string(tokenizer: &TokenizerInfo, id: u32) -> String {
    tokenizer.decode_all(&[id])
}

#[derive(Debug, Default, Serialize, ToSchema)]
pub struct CompletionLogprobs {
    tokens: Vec<String>,
    token_logprobs: Vec<Option<f32>>,
    top_logprobs: Vec<Option<HashMap<String, f32>>>,
    /// Where each token starts in the choice's text (echoed prompt, then completion).
    text_offset: Vec<usize>,
    /// The offset just past the last token.
    #[serde(skip)]
    end: Option<usize>,
}

impl CompletionLogprobs {
    /// Logprobs of `tokens` and, `with_top`, their alternatives: `top[i - top_offset]`
    /// belongs to `tokens[i]`. Text offsets count from `start`; a special token (a BOS)
    /// is not in the choice's text, so it takes no room there.
    pub(super) fn of(
        tokenizer: &TokenizerInfo,
        tokens: &[Token],
        top: &[Vec<Token>],
        top_offset: usize,
        start: usize,
        with_top: bool,
    ) -> Self {
        let mut out = Self::default();
        let mut offset = start;
        for (i, t) in tokens.iter().enumerate() {
            let text = token_string(tokenizer, t.id);
            out.text_offset.push(offset);
            if !t.special {
                offset += text.len();
            }
            out.tokens.push(text);
            out.token_logprobs.push(t.logprob);
            let alternatives = i.checked_sub(top_offset).and_then(|j| top.get(j));
            out.top_logprobs
                .push(match (with_top, alternatives, t.logprob) {
                    (true, Some(alts), Some(_)) => Some(
                        alts.iter()
                            .map(|a| (token_string(tokenizer, a.id), a.logprob.unwrap_or(0.0)))
                            .collect(),
                    ),
                    _ => None,
                });
        }
        out.end = (!tokens.is_empty()).then_some(offset);
        out
    }

    /// The text offset just past the last token.
    pub(super) fn end_offset(&self) -> Option<usize> {
        self.end
    }

    /// `self` followed by `more`.
    pub(super) fn append(&mut self, more: Self) {
        self.tokens.extend(more.tokens);
        self.token_logprobs.extend(more.token_logprobs);
        self.top_logprobs.extend(more.top_logprobs);
        self.text_offset.extend(more.text_offset);
        self.end = more.end.or(self.end);
    }
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct TopLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatTokenLogprob {
    token: String,
    logprob: f32,
    bytes: Vec<u8>,
    top_logprobs: Vec<TopLogprob>,
}

#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ChatLogprobs {
    content: Vec<ChatTokenLogprob>,
}

impl TopLogprob {
    fn of(tokenizer: &TokenizerInfo, t: &Token) -> Self {
        let token = token_string(tokenizer, t.id);
        Self {
            bytes: token.clone().into_bytes(),
            token,
            logprob: t.logprob.unwrap_or(0.0),
        }
    }
}

impl ChatLogprobs {
    /// Logprobs of `tokens`, each with its alternatives `top[i]` (none when missing).
    pub(super) fn of(tokenizer: &TokenizerInfo, tokens: &[Token], top: &[Vec<Token>]) -> Self {
        let content = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let TopLogprob {
                    token,
                    logprob,
                    bytes,
                } = TopLogprob::of(tokenizer, t);
                let top_logprobs = top
                    .get(i)
                    .map(|alts| alts.iter().map(|a| TopLogprob::of(tokenizer, a)).collect())
                    .unwrap_or_default();
                ChatTokenLogprob {
                    token,
                    logprob,
                    bytes,
                    top_logprobs,
                }
            })
            .collect();
        Self { content }
    }
}
