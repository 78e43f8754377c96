//! The router's validation speaks TGI's names (`inputs`, `parameters.max_new_tokens`);
//! an API's client sent other names for the same fields. `ParamNames` says how one API
//! names them, and rewrites a validation message so it names only what that client sent.

use crate::validation::{DO_SAMPLE_HINT, TRUNCATE_HINT};

/// How one API names the TGI parameters its requests set; `None` keeps TGI's name
/// (without `parameters.`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct ParamNames {
    pub inputs: Option<&'static str>,
    pub max_new_tokens: Option<&'static str>,
    pub top_n_tokens: Option<&'static str>,
    pub stop: Option<&'static str>,
    pub decoder_input_details: Option<&'static str>,
    pub adapter_id: Option<&'static str>,
}

impl ParamNames {
    /// TGI's names, `parameters.` left out.
    pub const TGI: Self = Self {
        inputs: None,
        max_new_tokens: None,
        top_n_tokens: None,
        stop: None,
        decoder_input_details: None,
        adapter_id: None,
    };

    /// The API's name of a TGI parameter (given without `parameters.`).
    fn rename<'a>(&self, tgi: &'a str) -> &'a str {
        let renamed = match tgi {
            "inputs" => self.inputs,
            "max_new_tokens" => self.max_new_tokens,
            "top_n_tokens" => self.top_n_tokens,
            "stop" => self.stop,
            "decoder_input_details" => self.decoder_input_details,
            "adapter_id" => self.adapter_id,
            _ => None,
        };
        renamed.unwrap_or(tgi)
    }

    /// A validation message in the API's names, and the field it is about (its first
    /// word): the TGI parameters it names renamed, the hints about `parameters.truncate`
    /// and `parameters.do_sample` (which no other API has) dropped.
    pub fn message(&self, message: &str) -> (String, Option<String>) {
        let field = message
            .split([' ', ':', '('])
            .next()
            .unwrap_or_default()
            .trim_start_matches("parameters.");
        let name = self.rename(field);
        let (head, rest) = if name.is_empty() {
            (String::new(), message.to_string())
        } else {
            let rest = message.split_once(field).map_or("", |(_, r)| r);
            (name.to_string(), rest.to_string())
        };
        let mut rest = rest.replace(TRUNCATE_HINT, "").replace(DO_SAMPLE_HINT, "");
        while let Some(at) = rest.find("parameters.") {
            let after = &rest[at + "parameters.".len()..];
            let end = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            let renamed = self.rename(&after[..end]).to_string();
            rest.replace_range(at..at + "parameters.".len() + end, &renamed);
        }
        let param = (!name.is_empty()).then(|| name.to_string());
        (format!("{head}{rest}"), param)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHAT: ParamNames = ParamNames {
        inputs: Some("messages"),
        max_new_tokens: Some("max_tokens"),
        ..ParamNames::TGI
    };

    #[test]
    fn tgi_names_become_the_apis_own_everywhere_in_the_message() {
        let (message, param) = CHAT.message(
            "inputs tokens + parameters.max_new_tokens must be <= 64 (max_total_tokens), got \
             41 + 30 = 71",
        );
        assert_eq!(
            message,
            "messages tokens + max_tokens must be <= 64 (max_total_tokens), got 41 + 30 = 71"
        );
        assert_eq!(param.as_deref(), Some("messages"));
        let (message, param) = CHAT.message("parameters.max_new_tokens must be strictly positive");
        assert_eq!(message, "max_tokens must be strictly positive");
        assert_eq!(param.as_deref(), Some("max_tokens"));
        let long = format!(
            "inputs must have less than 33 tokens (max_input_tokens), got 40{TRUNCATE_HINT}"
        );
        assert_eq!(
            CHAT.message(&long).0,
            "messages must have less than 33 tokens (max_input_tokens), got 40"
        );
        let (message, param) = CHAT.message("parameters.top_k must be strictly positive, got 0");
        assert_eq!(message, "top_k must be strictly positive, got 0");
        assert_eq!(param.as_deref(), Some("top_k"));
    }
}
