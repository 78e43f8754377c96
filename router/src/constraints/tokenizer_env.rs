//! The model's vocabulary as llguidance sees it: the bytes of every token in a trie (with
//! special tokens marked), padded to the width of the model's logits, and the router's
//! own tokenizer for turning forced text into tokens.

use std::sync::Arc;

use serde_json::Value;
use tokenizers::Tokenizer;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId};

struct RouterTokenizerEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl toktrie::TokenizerEnv for RouterTokenizerEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        // The trie splits at byte sequences that are not valid UTF-8; text goes to the
        // model's own tokenizer so that forced text is tokenized as the model would be.
        self.trie.tokenize_with_greedy_fallback(bytes, |text| {
            self.tokenizer
                .encode(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

/// The environment llguidance compiles grammars against. `logits_width` is the model's
/// vocabulary size (rows of the logits, which may exceed the tokenizer's); the rows past
/// the tokenizer are placeholder special tokens no grammar can produce. Every id in
/// `eos` ends a grammar that allows the end.
pub fn tok_env(
    tokenizer: Arc<Tokenizer>,
    logits_width: usize,
    eos: &[u32],
) -> Result<TokEnv, String> {
    let json: Value = serde_json::from_str(
        &tokenizer
            .to_string(false)
            .map_err(|e| format!("serializing the tokenizer: {e}"))?,
    )
    .map_err(|e| format!("reading the tokenizer: {e}"))?;
    let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
        .map_err(|e| format!("the tokenizer's vocabulary: {e}"))?;
    if words.len() > logits_width {
        return Err(format!(
            "the tokenizer has {} tokens but the model's logits only {logits_width}",
            words.len()
        ));
    }
    for (id, word) in words.iter_mut().enumerate() {
        if word.is_empty() {
            *word = placeholder(id);
        }
    }
    while words.len() < logits_width {
        words.push(placeholder(words.len()));
    }
    let &first_eos = eos
        .first()
        .ok_or("the model names no end-of-sequence token")?;
    let info = TokRxInfo::new(logits_width as u32, first_eos);
    let mut trie = TokTrie::from(&info, &words);
    if eos.len() > 1 {
        trie = trie.with_eos_tokens(eos);
    }
    Ok(Arc::new(RouterTokenizerEnv { trie, tokenizer }))
}

/// A special token no text can produce (ids the tokenizer leaves out).
fn placeholder(id: usize) -> Vec<u8> {
    let mut name = format!(".<[{id}]>").into_bytes();
    name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
    name
}
