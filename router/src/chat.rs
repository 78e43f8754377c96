//! Chat templates: the model's `chat_template` from `tokenizer_config.json`, rendered in
//! Rust with minijinja the way `transformers`' `apply_chat_template` renders it with
//! jinja2 (trim_blocks, lstrip_blocks, Python string methods, `raise_exception`).

use std::path::Path;

use minijinja::{Environment, ErrorKind};
use serde::Serialize;
use serde_json::Value;

const TEMPLATE: &str = "chat";

/// One message as the template sees it: `content` flattened to text.
#[derive(Debug, Clone, Serialize)]
pub struct TemplateMessage {
    pub role: String,
    pub content: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

/// A special token in tokenizer_config.json: a string or `{"content": ...}`.
fn token_text(value: Option<&Value>) -> String {
    match value {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Object(o)) => o
            .get("content")
            .and_then(Value::as_str)
            .unwrap_or_default()
            .to_string(),
        _ => String::new(),
    }
}

impl ChatTemplate {
    /// The template of `<dir>/tokenizer_config.json`; `None` when the model has none.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, String> {
        let path = if dir.is_dir() {
            dir.join("tokenizer_config.json")
        } else {
            dir.with_file_name("tokenizer_config.json")
        };
        let Ok(text) = std::fs::read_to_string(&path) else {
            return Ok(None);
        };
        let config: Value =
            serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
        let template = match config.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            // A list of named templates: the one called "default".
            Some(Value::Array(list)) => list
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template").and_then(Value::as_str))
                .unwrap_or_default()
                .to_string(),
            _ => String::new(),
        };
        if template.is_empty() {
            return Ok(None);
        }
        let bos = token_text(config.get("bos_token"));
        let eos = token_text(config.get("eos_token"));
        Self::new(template, bos, eos).map(Some)
    }

    pub fn new(template: String, bos_token: String, eos_token: String) -> Result<Self, String> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| e.to_string())?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |message: String| -> Result<String, _> {
            Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
        });
        env.add_template_owned(TEMPLATE, template)
            .map_err(|e| format!("invalid chat template: {e}"))?;
        Ok(Self {
            env,
            bos_token,
            eos_token,
        })
    }

    /// The prompt for `messages`, ending with the assistant's turn opened.
    pub fn render(&self, messages: &[TemplateMessage]) -> Result<String, String> {
        let template = self.env.get_template(TEMPLATE).map_err(|e| e.to_string())?;
        template
            .render(minijinja::context! {
                messages => minijinja::Value::from(minijinja::value::Serde(messages)),
                add_generation_prompt => true,
                bos_token => &self.bos_token,
                eos_token => &self.eos_token,
            })
            .map_err(|e| match e.kind() {
                ErrorKind::InvalidOperation => e.detail().unwrap_or("invalid messages").to_string(),
                _ => format!("chat template: {e}"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(role: &str, content: &str) -> TemplateMessage {
        TemplateMessage {
            role: role.into(),
            content: content.into(),
            name: None,
        }
    }

    #[test]
    fn renders_like_jinja2_with_python_methods_and_trimmed_blocks() {
        let template = "{{ bos_token }}{% for m in messages %}\n  {% if m.role == 'user' %}\n[U]{{ m.content.strip() }}\n  {% else %}\n[{{ m.role.upper() }}]{{ m.content }}\n  {% endif %}\n{% endfor %}{% if add_generation_prompt %}[A]{% endif %}";
        let t = ChatTemplate::new(template.into(), "<s>".into(), "</s>".into()).unwrap();
        let out = t
            .render(&[message("system", "be brief"), message("user", "  hi  ")])
            .unwrap();
        assert_eq!(out, "<s>[SYSTEM]be brief\n[U]hi\n[A]");
    }

    #[test]
    fn raise_exception_is_the_template_s_own_message() {
        let template = "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a user') }}{% endif %}";
        let t = ChatTemplate::new(template.into(), String::new(), String::new()).unwrap();
        let err = t.render(&[message("assistant", "x")]).unwrap_err();
        assert_eq!(err, "Conversations must start with a user");
    }

    #[test]
    fn a_list_of_named_templates_uses_the_default_one() {
        let dir = std::env::temp_dir().join(format!("cadence-chat-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let config = serde_json::json!({
            "bos_token": {"content": "<s>"},
            "chat_template": [
                {"name": "tool_use", "template": "tools"},
                {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}
            ]
        });
        std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
        let t = ChatTemplate::from_dir(&dir).unwrap().unwrap();
        assert_eq!(t.render(&[message("user", "yo")]).unwrap(), "<s>yo");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
