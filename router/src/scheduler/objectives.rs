//! The Gateway API Inference Extension names a request's objective in the
//! `x-gateway-inference-objective` header (an InferenceObjective of the pool, which carries
//! a priority there). `--objective-priorities NAME=P,...` tells cadence the priority of
//! each objective, so `--scheduling-policy priority` orders requests a gateway sends
//! without a `priority` field. A request's own `priority` wins; an objective not in the
//! map is priority 0, as a request without one.

use std::collections::HashMap;

/// The request header the gateway's endpoint picker forwards.
pub const OBJECTIVE_HEADER: &str = "x-gateway-inference-objective";

/// Objective name -> priority (lower runs first).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ObjectivePriorities(HashMap<String, i64>);

impl ObjectivePriorities {
    /// From `NAME=P` items (the flag's comma-separated values); errors name the item.
    pub fn parse(items: &[String]) -> Result<Self, String> {
        let mut map = HashMap::new();
        for item in items.iter().filter(|i| !i.is_empty()) {
            let parsed = item
                .split_once('=')
                .and_then(|(name, p)| Some((name.trim(), p.trim().parse::<i64>().ok()?)))
                .filter(|(name, _)| !name.is_empty());
            let Some((name, priority)) = parsed else {
                return Err(format!(
                    "--objective-priorities {item:?}: NAME=PRIORITY, the priority an integer"
                ));
            };
            map.insert(name.to_string(), priority);
        }
        Ok(Self(map))
    }

    /// The priority a request runs at: its own, else its objective's, else 0.
    pub fn priority(&self, own: Option<i64>, objective: Option<&str>) -> Option<i64> {
        own.or_else(|| objective.and_then(|o| self.0.get(o).copied()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_runs_at_its_own_priority_else_its_objectives() {
        let items = ["critical=-10".to_string(), " batch = 5 ".to_string()];
        let map = ObjectivePriorities::parse(&items).unwrap();
        assert_eq!(map.priority(None, Some("critical")), Some(-10));
        assert_eq!(map.priority(None, Some("batch")), Some(5));
        assert_eq!(
            map.priority(Some(2), Some("critical")),
            Some(2),
            "its own wins"
        );
        assert_eq!(map.priority(None, Some("unknown")), None);
        assert_eq!(map.priority(None, None), None);
    }

    #[test]
    fn a_bad_item_is_named() {
        for bad in ["critical", "=3", "batch=high"] {
            let error = ObjectivePriorities::parse(&[bad.to_string()]).unwrap_err();
            assert!(error.contains(bad), "{error}");
        }
    }
}
