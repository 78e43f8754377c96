//! A request's `model`: the base model or a LoRA adapter (as vLLM reads it).

use super::error::ApiError;
use super::state::AppState;

/// What TGI's own clients send as `model` when they are given a URL and no model name
/// (`text_generation`'s and `huggingface_hub`'s chat): TGI serves them the model, so do we.
const TGI_CLIENT_PLACEHOLDERS: &[&str] = &["tgi", "dummy"];

/// The adapter a request's `model` names: None for the base model (one of its served
/// names or its id, or no `model`), an adapter's name, or a 404 in OpenAI's shape for any
/// other name, as vLLM answers (a client naming a model it is not talking to learns so),
/// but for the placeholders TGI's clients send. TGI's routes do not ask: TGI serves any
/// name.
pub(crate) fn model_adapter(
    state: &AppState,
    model: Option<&str>,
) -> Result<Option<String>, ApiError> {
    let Some(model) = model.filter(|m| !m.is_empty()) else {
        return Ok(None);
    };
    if state.info.names_base_model(model) || TGI_CLIENT_PLACEHOLDERS.contains(&model) {
        return Ok(None);
    }
    if state.infer.adapters().resolve(model) {
        return Ok(Some(model.to_string()));
    }
    Err(ApiError::model_not_found(model))
}
