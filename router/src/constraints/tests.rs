//! The engine against the test tokenizer (one token per byte, a few merges, an EOS).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use super::*;
use crate::detokenize::testing;

fn compiler(bound: Duration) -> Compiler {
    let tokenizer = testing::tokenizer();
    let env = tok_env(
        tokenizer.tokenizer.clone(),
        tokenizer.vocab_size(),
        &[testing::eos_id()],
    )
    .unwrap();
    Compiler::new(&env, bound).unwrap()
}

fn shape() -> MaskShape {
    MaskShape {
        logits_width: testing::tokenizer().vocab_size(),
        eos: Arc::from(vec![testing::eos_id()]),
    }
}

fn allowed(words: &[u32], token: u32) -> bool {
    words[token as usize / 32] >> (token % 32) & 1 == 1
}

fn state(grammar: Grammar) -> GrammarState {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let c = compiler(Duration::from_secs(5));
    let (compiled, _) = rt
        .block_on(c.compile(&Constraint::new("guided_x", grammar)))
        .unwrap();
    GrammarState::new(&compiled)
}

#[test]
fn a_regex_masks_every_position_and_allows_eos_only_at_its_end() {
    let mut s = state(Grammar::Regex("a+b".into()));
    let eos = testing::eos_id();
    let words = s.allowed(&shape()).unwrap();
    assert_eq!(words.len(), shape().logits_width.div_ceil(32));
    assert!(allowed(&words, b'a' as u32));
    assert!(!allowed(&words, b'b' as u32) && !allowed(&words, eos));
    s.commit(b'a' as u32).unwrap();
    let words = s.allowed(&shape()).unwrap();
    assert!(allowed(&words, b'a' as u32) && allowed(&words, b'b' as u32));
    assert!(!allowed(&words, eos));
    s.commit(b'b' as u32).unwrap();
    let words = s.allowed(&shape()).unwrap();
    assert!(allowed(&words, eos));
    assert!(!allowed(&words, b'a' as u32));
    assert!(s.commit(b'c' as u32).is_err() || s.ended());
}

#[test]
fn a_choice_fast_forwards_what_it_forces() {
    let mut s = state(Grammar::Choice(vec!["hello".into(), "world".into()]));
    let words = s.allowed(&shape()).unwrap();
    assert!(allowed(&words, b'h' as u32) && allowed(&words, b'w' as u32));
    assert!(!allowed(&words, b'x' as u32));
    s.commit(b'w' as u32).unwrap();
    let forced = s.fast_forward(100);
    let tokenizer = testing::tokenizer();
    let text = tokenizer.decode(&forced);
    assert!(!forced.is_empty() && "orld".starts_with(&text), "{text:?}");
    // The rest of the word is still allowed (or already taken), nothing else is.
    let rest = &"orld"[text.len()..];
    let words = s.allowed(&shape()).unwrap();
    match rest.bytes().next() {
        Some(b) => assert!(allowed(&words, b as u32)),
        None => assert!(allowed(&words, testing::eos_id())),
    }
    assert!(!allowed(&words, b'h' as u32));
    assert!(s.fast_forward(0).is_empty());
}

#[test]
fn a_json_schema_is_written_compactly_and_its_keys_are_forced() {
    let schema = json!({"type": "object", "properties": {"n": {"type": "integer"}},
                        "required": ["n"], "additionalProperties": false});
    let mut s = state(Grammar::JsonSchema(schema));
    let words = s.allowed(&shape()).unwrap();
    assert!(allowed(&words, b'{' as u32));
    assert!(!allowed(&words, b' ' as u32), "no leading whitespace");
    s.commit(b'{' as u32).unwrap();
    let forced = s.fast_forward(100);
    assert_eq!(testing::tokenizer().decode(&forced), "\"n\": ");
    s.commit(b'7' as u32).unwrap();
    let words = s.allowed(&shape()).unwrap();
    assert!(allowed(&words, b'}' as u32) && allowed(&words, b'0' as u32));
    assert!(!allowed(&words, b',' as u32) && !allowed(&words, testing::eos_id()));
}

#[tokio::test]
async fn errors_name_the_field_and_the_cache_answers_the_second_time() {
    let c = compiler(Duration::from_secs(5));
    let bad = Constraint::new(
        "response_format",
        Grammar::JsonSchema(json!({"type": "object", "properties": {"a": {"type": "nope"}}})),
    );
    let err = c.compile(&bad).await.unwrap_err();
    assert!(err.0.starts_with("response_format: "), "{}", err.0);
    let bad_lark = Constraint::new(
        "guided_grammar",
        Grammar::Lark("start: undefined_rule".into()),
    );
    let err = c.compile(&bad_lark).await.unwrap_err();
    assert!(err.0.starts_with("guided_grammar: "), "{}", err.0);
    let good = Constraint::new("guided_regex", Grammar::Regex("[0-9]+".into()));
    let (_, first) = c.compile(&good).await.unwrap();
    let (_, second) = c.compile(&good).await.unwrap();
    assert!(first.is_some() && second.is_none());
}

#[tokio::test]
async fn a_compile_past_the_bound_fails_its_request_with_a_clear_error() {
    let c = compiler(Duration::ZERO);
    let options: Vec<String> = (0..5000).map(|i| format!("option-{i}")).collect();
    let slow = Constraint::new("guided_choice", Grammar::Choice(options));
    let err = c.compile(&slow).await.unwrap_err();
    assert!(
        err.0
            .contains("guided_choice: compiling the grammar took longer than 0 ms"),
        "{}",
        err.0
    );
}

#[tokio::test]
async fn the_deepest_schema_a_request_body_can_hold_compiles_or_fails_cleanly() {
    // serde_json refuses bodies nested deeper than 128; each level here nests 2.
    let mut schema = json!({"type": "string"});
    for _ in 0..62 {
        schema = json!({"type": "object", "properties": {"a": schema}, "required": ["a"]});
    }
    let text = schema.to_string();
    let parsed: serde_json::Value = serde_json::from_str(&text).unwrap();
    let c = compiler(Duration::from_secs(5));
    match c
        .compile(&Constraint::new("guided_json", Grammar::JsonSchema(parsed)))
        .await
    {
        Ok((compiled, _)) => {
            let mut s = GrammarState::new(&compiled);
            let words = s.allowed(&shape()).unwrap();
            assert!(allowed(&words, b'{' as u32));
        }
        Err(e) => assert!(e.0.starts_with("guided_json: "), "{}", e.0),
    }
}
