use super::*;

fn thinking(parser: ReasoningParser, prompt: &str) -> Thinking {
    Thinking::of(Some(parser), prompt).unwrap()
}

fn split(reasoning: Option<&str>, content: &str) -> Split {
    Split {
        reasoning: reasoning.map(str::to_string),
        content: content.to_string(),
    }
}

/// `text` streamed in pieces of `size` characters, the parts added up.
fn streamed(t: &Thinking, text: &str, size: usize) -> Split {
    let chars: Vec<char> = text.chars().collect();
    let pieces: Vec<String> = chars.chunks(size).map(|c| c.iter().collect()).collect();
    let mut stream = t.stream();
    let (mut reasoning, mut content) = (String::new(), String::new());
    for (i, piece) in pieces.iter().enumerate() {
        let parts = stream.next(piece, i + 1 == pieces.len());
        // Reasoning never follows answer text.
        assert!(parts.reasoning.is_empty() || content.is_empty(), "{text:?}");
        reasoning.push_str(&parts.reasoning);
        content.push_str(&parts.content);
    }
    Split {
        reasoning: (!reasoning.is_empty()).then_some(reasoning),
        content,
    }
}

#[test]
fn no_parser_splits_nothing() {
    assert!(Thinking::of(None, "<think>").is_none());
}

#[test]
fn both_tags_split_reasoning_from_the_answer() {
    for parser in [ReasoningParser::DeepseekR1, ReasoningParser::Qwen3] {
        let t = thinking(parser, "user: hi\nassistant:");
        let out = t.split("<think>Let me see.\n</think>\n\nIt is 4.");
        assert_eq!(out, split(Some("Let me see.\n"), "\n\nIt is 4."));
    }
}

#[test]
fn a_prompt_that_opened_think_starts_in_the_reasoning_for_both_parsers() {
    for parser in [ReasoningParser::DeepseekR1, ReasoningParser::Qwen3] {
        let t = thinking(parser, "<|im_start|>assistant\n<think>\n");
        assert_eq!(t.split("so 2+2=4</think>4"), split(Some("so 2+2=4"), "4"));
    }
}

#[test]
fn without_an_opening_deepseek_reasons_and_qwen3_answers() {
    let text = "hmm</think>Four.";
    let r1 = thinking(ReasoningParser::DeepseekR1, "Q: 2+2?");
    assert_eq!(r1.split(text), split(Some("hmm"), "Four."));
    let qwen = thinking(ReasoningParser::Qwen3, "Q: 2+2?");
    assert_eq!(qwen.split(text), split(None, text));
}

#[test]
fn a_prompt_with_the_empty_think_block_answers_directly() {
    let prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n";
    for parser in [ReasoningParser::DeepseekR1, ReasoningParser::Qwen3] {
        let t = thinking(parser, prompt);
        assert_eq!(t.split("Four."), split(None, "Four."));
        assert_eq!(t.split("a</think>b"), split(None, "a</think>b"));
    }
}

#[test]
fn output_without_tags_is_all_answer_for_qwen3_and_all_reasoning_for_deepseek() {
    let qwen = thinking(ReasoningParser::Qwen3, "Q:");
    assert_eq!(qwen.split("just text <b>"), split(None, "just text <b>"));
    let r1 = thinking(ReasoningParser::DeepseekR1, "Q:");
    assert_eq!(r1.split("just text <b>"), split(Some("just text <b>"), ""));
    // A `<think>` later than the start is text.
    assert_eq!(qwen.split("a <think>b"), split(None, "a <think>b"));
}

#[test]
fn an_unterminated_think_is_all_reasoning() {
    let t = thinking(ReasoningParser::Qwen3, "Q:");
    assert_eq!(
        t.split("<think>still going</thi"),
        split(Some("still going</thi"), "")
    );
    assert_eq!(t.split("<thi"), split(None, "<thi"));
    assert_eq!(t.split("<think>"), split(None, ""));
}

#[test]
fn streamed_in_any_pieces_the_parts_add_up_to_the_whole_split() {
    let cases = [
        (
            ReasoningParser::Qwen3,
            "Q:",
            "<think>a < b </th and </think>Then <think> x",
        ),
        (ReasoningParser::Qwen3, "Q:", "<thin>k no tag"),
        (ReasoningParser::DeepseekR1, "Q:", "é<</think></think>"),
        (
            ReasoningParser::DeepseekR1,
            "Q:",
            "<think>ends inside </think",
        ),
        (ReasoningParser::Qwen3, "<think>\n", "r</think>c"),
        (ReasoningParser::DeepseekR1, "Q:", ""),
    ];
    for (parser, prompt, text) in cases {
        let t = thinking(parser, prompt);
        let whole = t.split(text);
        for size in 1..=text.chars().count().max(1) {
            assert_eq!(
                streamed(&t, text, size),
                whole,
                "{text:?} in pieces of {size}"
            );
        }
    }
}

#[test]
fn a_tag_split_over_tokens_is_held_back_until_known() {
    let t = thinking(ReasoningParser::Qwen3, "<think>\n");
    let mut stream = t.stream();
    assert_eq!(stream.next("abc</", false).reasoning, "abc");
    let parts = stream.next("think", false);
    assert_eq!(parts, Parts::default());
    let parts = stream.next(">Hi", false);
    assert_eq!(
        (parts.reasoning.as_str(), parts.content.as_str()),
        ("", "Hi")
    );
    // Not a tag after all: the held text is reasoning.
    let mut stream = t.stream();
    assert_eq!(stream.next("a</th", false).reasoning, "a");
    assert_eq!(stream.next("ing", false).reasoning, "</thing");
}
