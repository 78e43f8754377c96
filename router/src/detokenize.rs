//! Incremental detokenization: turns one token id at a time into text, so streaming
//! clients see characters as soon as they are complete.
//!
//! The prefix_offset/read_offset technique: decode a short window of recent ids twice,
//! without and with the newest tokens, and emit only what was added. Output is held back
//! while the window ends in an incomplete UTF-8 character (decoded as U+FFFD), so a
//! character split over several byte tokens arrives whole with the token that completes
//! it. The window starts with a few prompt tokens so tokenizers that drop a leading space
//! at the start of a text decode the first generated token correctly.

use std::collections::HashSet;
use std::path::Path;
use std::sync::Arc;

use tokenizers::Tokenizer;

/// Prompt tokens used as decoding context for the first generated tokens.
const PROMPT_CONTEXT: usize = 5;
/// Ids kept before the decoding window before the buffer is compacted.
const COMPACT_AFTER: usize = 64;

/// The tokenizer with what the router needs to know about its vocabulary.
#[derive(Clone)]
pub struct TokenizerInfo {
    pub tokenizer: Arc<Tokenizer>,
    special: Arc<HashSet<u32>>,
}

impl TokenizerInfo {
    pub fn new(tokenizer: Tokenizer) -> Self {
        let special = tokenizer
            .get_added_tokens_decoder()
            .into_iter()
            .filter(|(_, token)| token.special)
            .map(|(id, _)| id)
            .collect();
        Self {
            tokenizer: Arc::new(tokenizer),
            special: Arc::new(special),
        }
    }

    /// Loads `<dir>/tokenizer.json` (or the file itself when given a file).
    pub fn from_dir(path: &Path) -> Result<Self, String> {
        let file = if path.is_dir() {
            path.join("tokenizer.json")
        } else {
            path.to_path_buf()
        };
        let tokenizer = Tokenizer::from_file(&file).map_err(|e| e.to_string())?;
        Ok(Self::new(tokenizer))
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special.contains(&id)
    }

    /// Tokenizes a prompt, adding the model's special tokens (BOS).
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        self.encode_with(text, true)
    }

    /// Tokenizes a prompt, with or without the model's special tokens.
    pub fn encode_with(&self, text: &str, add_special: bool) -> Result<Vec<u32>, String> {
        self.tokenizer
            .encode(text, add_special)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| e.to_string())
    }

    /// Ids with the character span of each in `text` (`/tokenize`).
    pub fn encode_offsets(&self, text: &str) -> Result<Vec<(u32, usize, usize)>, String> {
        let encoding = self
            .tokenizer
            .encode(text, true)
            .map_err(|e| e.to_string())?;
        Ok(encoding
            .get_ids()
            .iter()
            .zip(encoding.get_offsets())
            .map(|(&id, &(start, stop))| (id, start, stop))
            .collect())
    }

    /// Ids in the vocabulary, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.tokenizer.get_vocab_size(true)
    }

    /// Decodes ids, special tokens included (a prompt given as ids, echoed back).
    pub fn decode_all(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, false).unwrap_or_default()
    }

    /// Decodes ids, skipping special tokens. Decoding errors give an empty string.
    pub fn decode(&self, ids: &[u32]) -> String {
        self.tokenizer.decode(ids, true).unwrap_or_default()
    }

    /// The text of one token on its own (top-n alternatives).
    pub fn token_text(&self, id: u32) -> String {
        if self.is_special(id) {
            return String::new();
        }
        self.decode(&[id])
    }
}

/// One request's decoding state.
#[derive(Debug, Clone)]
pub struct Detokenizer {
    ids: Vec<u32>,
    /// Start of the decoding window.
    prefix_offset: usize,
    /// End of the text already emitted.
    read_offset: usize,
}

impl Detokenizer {
    /// Starts after `prompt`, using its last tokens as context.
    pub fn new(prompt: &[u32]) -> Self {
        let ids = prompt[prompt.len().saturating_sub(PROMPT_CONTEXT)..].to_vec();
        Self {
            read_offset: ids.len(),
            prefix_offset: 0,
            ids,
        }
    }

    /// Adds a token; returns the text it completes (often "" for a partial character).
    pub fn push(&mut self, tok: &TokenizerInfo, id: u32) -> String {
        self.ids.push(id);
        self.advance(tok, false)
    }

    /// Returns any text still held back (the request finished).
    pub fn flush(&mut self, tok: &TokenizerInfo) -> String {
        self.advance(tok, true)
    }

    fn advance(&mut self, tok: &TokenizerInfo, force: bool) -> String {
        if self.read_offset == self.ids.len() {
            return String::new();
        }
        let prefix = tok.decode(&self.ids[self.prefix_offset..self.read_offset]);
        let full = tok.decode(&self.ids[self.prefix_offset..]);
        if !force && (full.len() <= prefix.len() || full.ends_with('\u{FFFD}')) {
            if full.len() <= prefix.len() && !full.ends_with('\u{FFFD}') {
                // Tokens that decode to nothing (special tokens): nothing to wait for.
                self.read_offset = self.ids.len();
            }
            return String::new();
        }
        let delta = match full.strip_prefix(prefix.as_str()) {
            Some(rest) => rest.to_string(),
            None => {
                // The window decodes differently with more tokens (rare normalizing
                // decoders): emit what follows the longest common prefix.
                let common = full
                    .char_indices()
                    .zip(prefix.chars())
                    .take_while(|((_, a), b)| a == b)
                    .last()
                    .map(|((i, c), _)| i + c.len_utf8())
                    .unwrap_or(0);
                full[common..].to_string()
            }
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        if self.prefix_offset > COMPACT_AFTER {
            self.ids.drain(..self.prefix_offset);
            self.read_offset -= self.prefix_offset;
            self.prefix_offset = 0;
        }
        delta
    }
}

#[cfg(test)]
pub(crate) mod testing {
    //! A tiny byte-level BPE tokenizer built in memory: one token per byte, a few merges,
    //! and two special tokens, so multi-byte characters are split over several tokens.

    use super::TokenizerInfo;
    use tokenizers::Tokenizer;

    pub const EOS: &str = "<|eos|>";

    pub fn tokenizer_json() -> String {
        // GPT-2's byte-to-unicode table.
        let mut bytes: Vec<u32> = (b'!' as u32..=b'~' as u32)
            .chain(0xA1..=0xAC)
            .chain(0xAE..=0xFF)
            .collect();
        let mut chars = bytes.clone();
        let mut n = 0;
        for b in 0..256u32 {
            if !bytes.contains(&b) {
                bytes.push(b);
                chars.push(256 + n);
                n += 1;
            }
        }
        let mut pairs: Vec<(u32, char)> = bytes
            .iter()
            .zip(&chars)
            .map(|(&b, &c)| (b, char::from_u32(c).unwrap()))
            .collect();
        pairs.sort();
        let mut vocab = serde_json::Map::new();
        for (b, c) in &pairs {
            vocab.insert(c.to_string(), (*b).into());
        }
        let merges = [("h", "e"), ("l", "l"), ("he", "ll"), ("Ġ", "w")];
        for (id, (a, b)) in (256u32..).zip(merges) {
            vocab.insert(format!("{a}{b}"), id.into());
        }
        let merges: Vec<String> = merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
        serde_json::json!({
            "version": "1.0",
            "truncation": null,
            "padding": null,
            "added_tokens": [
                {"id": 260, "content": EOS, "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": true},
                {"id": 261, "content": "<|bos|>", "single_word": false, "lstrip": false,
                 "rstrip": false, "normalized": false, "special": true}
            ],
            "normalizer": null,
            "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false,
                              "trim_offsets": true, "use_regex": true},
            "post_processor": {"type": "TemplateProcessing",
                "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}},
                           {"Sequence": {"id": "A", "type_id": 0}}],
                "pair": [{"Sequence": {"id": "A", "type_id": 0}},
                         {"Sequence": {"id": "B", "type_id": 1}}],
                "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [261],
                                               "tokens": ["<|bos|>"]}}},
            "decoder": {"type": "ByteLevel", "add_prefix_space": true,
                        "trim_offsets": true, "use_regex": true},
            "model": {"type": "BPE", "dropout": null, "unk_token": null,
                      "continuing_subword_prefix": null, "end_of_word_suffix": null,
                      "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
                      "vocab": vocab, "merges": merges}
        })
        .to_string()
    }

    pub fn tokenizer() -> TokenizerInfo {
        let tokenizer: Tokenizer = tokenizer_json().parse().expect("valid tokenizer.json");
        TokenizerInfo::new(tokenizer)
    }

    pub fn eos_id() -> u32 {
        260
    }
}

#[cfg(test)]
mod tests {
    use super::testing::tokenizer;
    use super::*;

    fn stream(tok: &TokenizerInfo, prompt: &[u32], ids: &[u32]) -> Vec<String> {
        let mut d = Detokenizer::new(prompt);
        let mut out: Vec<String> = ids.iter().map(|&id| d.push(tok, id)).collect();
        let rest = d.flush(tok);
        out.last_mut().unwrap().push_str(&rest);
        out
    }

    #[test]
    fn the_test_tokenizer_splits_multibyte_characters_into_byte_tokens() {
        let tok = tokenizer();
        let ids = tok.encode("日本").unwrap();
        assert_eq!(ids[0], 261); // BOS
        assert_eq!(ids.len(), 7); // BOS + 6 bytes
        assert_eq!(tok.decode(&ids), "日本");
        assert!(tok.is_special(261) && tok.is_special(260) && !tok.is_special(65));
    }

    #[test]
    fn multibyte_characters_split_over_tokens_arrive_whole_and_never_as_replacement() {
        let tok = tokenizer();
        for text in ["日本", "café au lait", "hello 👋🏽 world", "é", "aé日👍b"] {
            let ids = tok.encode(text).unwrap();
            let gen = &ids[1..];
            let pieces = stream(&tok, &ids[..1], gen);
            assert!(pieces.iter().all(|p| !p.contains('\u{FFFD}')), "{pieces:?}");
            assert_eq!(pieces.concat(), tok.decode(gen), "{text}");
            assert_eq!(pieces.concat(), text);
        }
        // "é" is two byte tokens: the first emits "", the second the whole character.
        let ids = tok.encode("é").unwrap();
        assert_eq!(
            stream(&tok, &ids[..1], &ids[1..]),
            vec!["".to_string(), "é".to_string()]
        );
    }

    #[test]
    fn prompt_context_and_special_tokens_do_not_leak_into_the_text() {
        let tok = tokenizer();
        let prompt = tok.encode("hello 日").unwrap();
        let gen = tok.encode(" world 本").unwrap()[1..].to_vec();
        let mut with_eos = gen.clone();
        with_eos.push(super::testing::eos_id());
        let pieces = stream(&tok, &prompt, &with_eos);
        assert_eq!(pieces.concat(), " world 本");
        assert_eq!(pieces.last().unwrap(), "");
    }

    #[test]
    fn long_generations_compact_the_window_and_stay_exact() {
        let tok = tokenizer();
        let text = "héllo wörld 日本語 ".repeat(40);
        let ids = tok.encode(&text).unwrap();
        let pieces = stream(&tok, &ids[..1], &ids[1..]);
        assert_eq!(pieces.concat(), text);
    }

    #[test]
    fn flush_emits_an_incomplete_character_at_the_end() {
        let tok = tokenizer();
        let ids = tok.encode("日").unwrap();
        let mut d = Detokenizer::new(&ids[..1]);
        assert_eq!(d.push(&tok, ids[1]), "");
        assert_eq!(d.flush(&tok), "\u{FFFD}");
    }
}
