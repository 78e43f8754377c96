//! The grammar the output follows when the model may call tools, in llguidance's Lark
//! dialect (`Grammar::Lark`), so every call the model writes is one `read` can take back:
//!
//! - `auto`: free text that never contains the trigger `<tool_call>`; once the model
//!   writes the trigger, the rest is calls, then only whitespace;
//! - `required`: calls at once, no text before them;
//! - a named function: one call to it, at once.
//!
//! Each call is `<tool_call>`, a JSON object `{"name": N, "arguments": A}` where A is
//! valid against N's `parameters` (one `anyOf` alternative per function, so the name
//! selects the schema), then `</tool_call>`; whitespace may surround the object and
//! separate calls. One call only when `parallel_tool_calls` is false.

use serde_json::{json, Map, Value};

use super::format::{CALL_CLOSE, CALL_OPEN};
use super::request::{Function, ToolChoice, Tools};
use crate::constraints::{Constraint, Grammar};
use crate::detokenize::TokenizerInfo;

/// Whether the tokenizer has `<tool_call>` and `</tool_call>` as tokens of their own
/// (Qwen2.5's has, SmolLM2's spells them in text). llguidance's token trie
/// (toktrie_hf_tokenizers) treats every added token written `<...>` as special, so the
/// grammar must name these tokens rather than spell the text.
pub fn tags_are_special(tokenizer: &TokenizerInfo) -> bool {
    let added = tokenizer.tokenizer.get_added_tokens_decoder();
    [CALL_OPEN, CALL_CLOSE]
        .iter()
        .all(|tag| added.values().any(|token| token.content == *tag))
}

/// The constraint of a request that may call tools; `None` under `tool_choice: "none"`.
/// `special_tags`: the tags are special tokens (`tags_are_special`), which the grammar
/// names instead of spelling their text.
pub fn constraint(tools: &Tools, special_tags: bool) -> Option<Constraint> {
    let one_call = !tools.parallel || matches!(tools.choice, ToolChoice::Function(_));
    let more = if one_call { "" } else { " (WS? call)*" };
    let (open, close) = if special_tags {
        (CALL_OPEN.to_string(), CALL_CLOSE.to_string())
    } else {
        (format!("{CALL_OPEN:?}"), format!("{CALL_CLOSE:?}"))
    };
    let start = match (&tools.choice, special_tags) {
        (ToolChoice::None, _) => return None,
        // The lexer does not end a text lexeme where a literal could start, so the text
        // and the trigger after it are one lexeme (it cannot go past the first trigger).
        (ToolChoice::Auto, false) => format!("TEXT? | TEXT_THEN_OPEN call_rest{more} WS?"),
        (ToolChoice::Auto, true) => format!("TEXT? (call{more} WS?)?"),
        (ToolChoice::Required | ToolChoice::Function(_), _) => format!("call{more} WS?"),
    };
    let schema = calls_schema(&tools.callable().collect::<Vec<_>>());
    // The trigger has no regex metacharacters, so it is its own pattern.
    let mut lark = format!(
        "%llguidance {{}}\n\
         start: {start}\n\
         call: {open} call_rest\n\
         call_rest: WS? call_object WS? {close}\n\
         call_object: %json {schema}\n\
         TEXT: /(?s:.+)/ & ~/(?s:.*){CALL_OPEN}(?s:.*)/\n\
         WS: /[ \\t\\r\\n]{{1,4}}/\n"
    );
    if tools.choice == ToolChoice::Auto && !special_tags {
        lark.push_str(&format!("TEXT_THEN_OPEN: TEXT? {open}\n"));
    }
    // A named or required call is what the request's tool_choice makes of it.
    let field = match tools.choice {
        ToolChoice::Auto => "tools",
        _ => "tool_choice",
    };
    Some(Constraint::new(field, Grammar::Lark(lark)))
}

/// `{"name": N, "arguments": A}` for one of `functions`, compact or with a space or two
/// between tokens: flexible whitespace without a bound lets small models pad without end.
fn calls_schema(functions: &[&Function]) -> Value {
    let mut schema = if let [function] = functions {
        call_schema(function, "/properties/arguments")
    } else {
        let options: Vec<Value> = functions
            .iter()
            .enumerate()
            .map(|(i, f)| call_schema(f, &format!("/anyOf/{i}/properties/arguments")))
            .collect();
        json!({"anyOf": options})
    };
    schema["x-guidance"] = json!({"whitespace_pattern": "[\\x20\\x0A\\x0D\\x09]{1,2}"});
    schema
}

/// One function's call; `at` is where its arguments schema sits in the whole document.
fn call_schema(function: &Function, at: &str) -> Value {
    json!({
        "type": "object",
        "properties": {
            "name": {"const": function.name},
            "arguments": rebased(function.parameters.clone(), at),
        },
        "required": ["name", "arguments"],
        "additionalProperties": false,
    })
}

/// The keywords whose value is a schema, a list of schemas, or a map of them.
const SCHEMA_KEYWORDS: &[&str] = &[
    "items",
    "additionalItems",
    "additionalProperties",
    "unevaluatedItems",
    "unevaluatedProperties",
    "contains",
    "propertyNames",
    "not",
    "if",
    "then",
    "else",
    "anyOf",
    "allOf",
    "oneOf",
    "prefixItems",
];
const SCHEMA_MAP_KEYWORDS: &[&str] = &[
    "properties",
    "patternProperties",
    "dependentSchemas",
    "$defs",
    "definitions",
];

/// `schema` moved to `at`: its local references (`#`, `#/$defs/X`) point into it there
/// (a tool's `parameters` often come with their own `$defs`). Values that are data, such
/// as `const` or `default`, are left as they are.
fn rebased(schema: Value, at: &str) -> Value {
    let Value::Object(map) = schema else {
        return match schema {
            Value::Array(list) => list.into_iter().map(|s| rebased(s, at)).collect(),
            other => other,
        };
    };
    let rebase_map = |m: Map<String, Value>| -> Map<String, Value> {
        m.into_iter().map(|(k, s)| (k, rebased(s, at))).collect()
    };
    map.into_iter()
        .map(|(key, value)| {
            let value = match value {
                Value::String(r) if key == "$ref" && r.starts_with('#') => {
                    Value::String(format!("#{at}{}", &r[1..]))
                }
                Value::Object(m) if SCHEMA_MAP_KEYWORDS.contains(&key.as_str()) => {
                    Value::Object(rebase_map(m))
                }
                v if SCHEMA_KEYWORDS.contains(&key.as_str()) => rebased(v, at),
                v => v,
            };
            (key, value)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use llguidance::api::TopLevelGrammar;
    use llguidance::toktrie::{
        ApproximateTokEnv, InferenceCapabilities, TokEnv, TokRxInfo, TokTrie,
    };
    use llguidance::{Matcher, ParserFactory};

    use super::*;
    use crate::api::tools::request::Function;

    fn function(name: &str, parameters: Value) -> Function {
        Function {
            name: name.into(),
            description: None,
            parameters,
        }
    }

    fn weather_tools(choice: ToolChoice, parallel: bool) -> Tools {
        let city = json!({"type": "object", "properties": {"city": {"type": "string"}},
            "required": ["city"], "additionalProperties": false});
        let count = json!({"type": "object", "properties": {"n": {"type": "integer"}},
            "required": ["n"]});
        Tools {
            functions: vec![function("get_weather", city), function("count", count)],
            choice,
            parallel,
        }
    }

    fn lark(tools: &Tools, special: bool) -> String {
        match constraint(tools, special).unwrap().grammar {
            Grammar::Lark(text) => text,
            other => panic!("not Lark: {other:?}"),
        }
    }

    /// One token per byte, and `<tool_call>`, `</tool_call>` as special tokens.
    fn special_env() -> TokEnv {
        let mut words: Vec<Vec<u8>> = (0..=255).map(|b| vec![b]).collect();
        for tag in [CALL_OPEN, CALL_CLOSE, "<|eos|>"] {
            let mut word = vec![TokTrie::SPECIAL_TOKEN_MARKER];
            word.extend_from_slice(tag.as_bytes());
            words.push(word);
        }
        let info = TokRxInfo::new(words.len() as u32, words.len() as u32 - 1);
        Arc::new(ApproximateTokEnv::new(TokTrie::from(&info, &words)))
    }

    /// `text` as tokens of `env`: bytes, the tags as their special tokens when it has them.
    fn tokens(env: &TokEnv, text: &str) -> Vec<u32> {
        let trie = env.tok_trie();
        let mut out = Vec::new();
        let mut rest = text;
        while !rest.is_empty() {
            let tag = [CALL_OPEN, CALL_CLOSE].into_iter().find_map(|t| {
                Some((t, trie.get_special_token(t)?)).filter(|_| rest.starts_with(t))
            });
            if let Some((tag, id)) = tag {
                out.push(id);
                rest = &rest[tag.len()..];
            } else {
                let c = rest.chars().next().unwrap();
                out.extend(c.to_string().bytes().map(u32::from));
                rest = &rest[c.len_utf8()..];
            }
        }
        out
    }

    /// Whether `text` is a whole output `lark` allows: every token taken, then EOS.
    fn accepts_in(env: &TokEnv, lark: &str, text: &str) -> bool {
        let factory = ParserFactory::new(env, InferenceCapabilities::default(), &[]).unwrap();
        let grammar = TopLevelGrammar::from_lark(lark.to_string());
        let mut matcher = Matcher::new(factory.create_parser(grammar));
        assert!(!matcher.is_error(), "{:?}\n{lark}", matcher.get_error());
        for token in tokens(env, text) {
            if matcher.try_consume_tokens(&[token]).unwrap() == 0 {
                return false;
            }
        }
        matcher.is_accepting().unwrap()
    }

    fn accepts(lark: &str, text: &str) -> bool {
        accepts_in(&ApproximateTokEnv::single_byte_env(), lark, text)
    }

    const PARIS: &str =
        "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>";
    const COUNT: &str = "<tool_call>{\"name\":\"count\",\"arguments\":{\"n\":3}}</tool_call>";

    fn check(
        lark: &str,
        accepted: &[&str],
        rejected: &[&str],
        accepts: impl Fn(&str, &str) -> bool,
    ) {
        for text in accepted {
            assert!(accepts(lark, text), "should accept {text:?}\n{lark}");
        }
        for text in rejected {
            assert!(!accepts(lark, text), "should reject {text:?}\n{lark}");
        }
    }

    #[test]
    fn whitespace_in_and_after_calls_is_bounded() {
        // Small models pad with whitespace when the grammar lets them, without end.
        let padded_json =
            "<tool_call>{\"name\":     \"count\",\"arguments\":{\"n\":3}}</tool_call>";
        let padded_after = format!("{COUNT}\n\n\n\n\n");
        let accepted = [COUNT, PARIS, &format!("{COUNT}\n")];
        let rejected = [padded_json, &padded_after];
        let lark = lark(&weather_tools(ToolChoice::Required, true), false);
        check(&lark, &accepted, &rejected, accepts);
    }

    #[test]
    fn auto_allows_text_or_text_then_calls() {
        let two = format!("{PARIS}\n{COUNT}");
        let text_then_call = format!("Let me look.\n{PARIS}\n");
        let accepted = [
            "",
            "It is sunny <tool and warm.",
            "a < b",
            PARIS,
            &text_then_call,
            &two,
            "ünïcode first\n<tool_call>{\"name\":\"count\",\"arguments\":{\"n\":-2}}</tool_call>",
        ];
        let after = format!("{PARIS} done");
        let order = "<tool_call>{\"arguments\":{\"n\":3},\"name\":\"count\"}</tool_call>";
        let rejected = [
            // The trigger commits to a call.
            "<tool_call> sure",
            "text <tool_call>",
            "<tool_call>{\"name\":\"nope\",\"arguments\":{}}</tool_call>",
            // Arguments against the schema: a number for a string, an extra key, none.
            "<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"city\":3}}</tool_call>",
            "<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"city\":\"a\",\"x\":1}}</tool_call>",
            "<tool_call>{\"name\":\"count\"}</tool_call>",
            // The name selects the schema: count's arguments under get_weather's name.
            "<tool_call>{\"name\":\"get_weather\",\"arguments\":{\"n\":3}}</tool_call>",
            order,
            &after,
        ];
        let lark = lark(&weather_tools(ToolChoice::Auto, true), false);
        check(&lark, &accepted, &rejected, accepts);
    }

    #[test]
    fn one_call_only_when_parallel_calls_are_off() {
        let lark = lark(&weather_tools(ToolChoice::Auto, false), false);
        let two = format!("{PARIS}{COUNT}");
        check(
            &lark,
            &["hi", PARIS, &format!("ok {COUNT}\n")],
            &[&two],
            accepts,
        );
        let lark = super::constraint(&weather_tools(ToolChoice::Required, false), false).unwrap();
        assert_eq!(lark.field, "tool_choice");
        let Grammar::Lark(lark) = lark.grammar else {
            panic!()
        };
        check(&lark, &[COUNT], &[&two], accepts);
    }

    #[test]
    fn required_calls_at_once() {
        let lark = lark(&weather_tools(ToolChoice::Required, true), false);
        let two = format!("{COUNT}\n\n{PARIS}\n");
        let late = format!("Sure. {PARIS}");
        let spaced = format!(" {PARIS}");
        check(
            &lark,
            &[PARIS, &two],
            &["", "Sure.", &late, &spaced],
            accepts,
        );
    }

    #[test]
    fn a_named_function_is_called_once_at_once() {
        let tools = weather_tools(ToolChoice::Function("count".into()), true);
        let lark = lark(&tools, false);
        let two = format!("{COUNT}{COUNT}");
        check(&lark, &[COUNT], &[PARIS, &two, "3", ""], accepts);
    }

    #[test]
    fn none_has_no_grammar_and_auto_is_named_after_tools() {
        assert!(constraint(&weather_tools(ToolChoice::None, true), false).is_none());
        let c = constraint(&weather_tools(ToolChoice::Auto, true), false).unwrap();
        assert_eq!(c.field, "tools");
    }

    #[test]
    fn special_tags_are_matched_as_tokens() {
        let env = special_env();
        let accepts = |lark: &str, text: &str| accepts_in(&env, lark, text);
        let lark = lark(&weather_tools(ToolChoice::Auto, true), true);
        assert!(lark
            .contains("call: <tool_call> call_rest\ncall_rest: WS? call_object WS? </tool_call>"));
        let text_then_call = format!("Let me look.\n{PARIS}\n");
        check(
            &lark,
            &["hi", PARIS, &text_then_call],
            &["<tool_call> sure"],
            accepts,
        );
        // The tags spelled in plain bytes are not the special tokens.
        let spelled: Vec<u32> = PARIS.bytes().map(u32::from).collect();
        let factory = ParserFactory::new(&env, InferenceCapabilities::default(), &[]).unwrap();
        let grammar = TopLevelGrammar::from_lark(lark.clone());
        let mut matcher = Matcher::new(factory.create_parser(grammar));
        let taken = matcher.try_consume_tokens(&spelled).unwrap();
        assert!(taken < spelled.len() || !matcher.is_accepting().unwrap());
        let required = self::lark(&weather_tools(ToolChoice::Required, false), true);
        check(&required, &[COUNT], &["hi"], accepts);
    }

    #[test]
    fn parameters_with_their_own_defs_and_awkward_text_compile() {
        let parameters = json!({
            "type": "object",
            "description": "braces } { and \"quotes\" and\nnewlines",
            "properties": {"unit": {"$ref": "#/$defs/unit"}, "at": {"$ref": "#/$defs/place"}},
            "required": ["unit"],
            "$defs": {
                "unit": {"enum": ["c", "f"]},
                "place": {"type": "object", "properties": {"near": {"$ref": "#/$defs/place"}}}
            }
        });
        for others in [vec![], vec![function("count", json!({"type": "object"}))]] {
            let mut functions = vec![function("temp", parameters.clone())];
            functions.extend(others);
            let tools = Tools {
                functions,
                choice: ToolChoice::Auto,
                parallel: true,
            };
            let lark = lark(&tools, false);
            let call = |args: &str| {
                format!("<tool_call>{{\"name\":\"temp\",\"arguments\":{args}}}</tool_call>")
            };
            check(
                &lark,
                &[
                    &call("{\"unit\":\"c\"}"),
                    &call("{\"unit\":\"f\",\"at\":{\"near\":{\"near\":{}}}}"),
                ],
                &[&call("{\"unit\":\"k\"}"), &call("{}")],
                accepts,
            );
        }
    }

    #[test]
    fn the_tags_are_special_when_the_tokenizer_added_them() {
        use crate::detokenize::{testing, TokenizerInfo};
        assert!(!tags_are_special(&testing::tokenizer()));
        let mut json: Value = serde_json::from_str(&testing::tokenizer_json()).unwrap();
        let added = json["added_tokens"].as_array_mut().unwrap();
        for (id, tag) in [(262, CALL_OPEN), (263, CALL_CLOSE)] {
            added.push(
                json!({"id": id, "content": tag, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": false}),
            );
        }
        let tokenizer = json.to_string().parse().unwrap();
        assert!(tags_are_special(&TokenizerInfo::new(tokenizer)));
    }

    #[test]
    fn rebasing_moves_local_references_only() {
        let schema = json!({
            "$ref": "#",
            "properties": {"a": {"$ref": "#/$defs/a"}, "$ref": {"type": "string"}},
            "items": [{"$ref": "#/$defs/b"}],
            "const": {"$ref": "#/kept"},
            "anyOf": [{"$ref": "other.json#/x"}]
        });
        assert_eq!(
            rebased(schema, "/p"),
            json!({
                "$ref": "#/p",
                "properties": {"a": {"$ref": "#/p/$defs/a"}, "$ref": {"type": "string"}},
                "items": [{"$ref": "#/p/$defs/b"}],
                "const": {"$ref": "#/kept"},
                "anyOf": [{"$ref": "other.json#/x"}]
            })
        );
    }
}
