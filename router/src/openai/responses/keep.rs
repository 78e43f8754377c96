//! What a finished response leaves in the store (`api::ResponseStore`): itself and the
//! conversation it answered, for `GET` and `previous_response_id`.

use std::sync::Arc;

use super::items::Item;
use super::object::{OutputItem, ResponseObject};
use crate::api::{ParamNames, ResponseStore};

/// The router's parameter names as this API names them.
pub(super) const NAMES: ParamNames = ParamNames {
    inputs: Some("input"),
    max_new_tokens: Some("max_output_tokens"),
    adapter_id: Some("model"),
    ..ParamNames::TGI
};

/// What a stored response holds.
#[derive(Debug)]
pub struct Stored {
    pub response: ResponseObject,
    /// The whole conversation up to and including its output, as the next turn's items
    /// (its instructions left out, as OpenAI leaves them).
    pub conversation: Vec<Item>,
}

/// Where a finished response goes: the store (unless the request said `store: false`),
/// with the conversation it answered.
pub(super) struct Keep {
    pub store: Option<Arc<ResponseStore>>,
    pub conversation: Vec<Item>,
}

impl Keep {
    pub fn keep(self, response: &ResponseObject) {
        let Some(store) = self.store else {
            return;
        };
        let mut conversation = self.conversation;
        conversation.extend(response.output.iter().filter_map(OutputItem::as_input));
        let stored = Stored {
            response: response.clone(),
            conversation,
        };
        store.put(response.id.clone(), stored);
    }
}
