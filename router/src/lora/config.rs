//! What the LoRA flags ask for: the adapters loaded at start, the folder adapters are
//! found in on first use, the host cache's and the batch's bounds, runtime loading.

use std::path::{Path, PathBuf};

/// The LoRA settings, from `--lora-adapters`, `--lora-dir`, `--max-cpu-adapters`,
/// `--max-adapters-per-batch` and `--allow-runtime-lora`.
#[derive(Debug, Clone)]
pub struct LoraConfig {
    /// Loaded at start, in order: (name, folder).
    pub adapters: Vec<(String, PathBuf)>,
    /// An unknown name N with `dir/N/adapter_config.json` is registered and loaded on first
    /// use.
    pub dir: Option<PathBuf>,
    /// Most adapters kept loaded in the shards' host memory (a soft bound: adapters in use
    /// or paged in are never forgotten).
    pub max_cpu_adapters: usize,
    /// Most distinct adapters among one replica's running requests.
    pub max_adapters_per_batch: usize,
    /// `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` are served.
    pub allow_runtime: bool,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            adapters: Vec::new(),
            dir: None,
            max_cpu_adapters: 64,
            max_adapters_per_batch: 32,
            allow_runtime: false,
        }
    }
}

impl LoraConfig {
    /// Whether any LoRA option is on: then OpenAI's `model` must name the base model or an
    /// adapter (without, any name is taken as the base model, as before adapters existed).
    pub fn enabled(&self) -> bool {
        !self.adapters.is_empty() || self.dir.is_some() || self.allow_runtime
    }

    /// The folder of adapter `name` under `--lora-dir`, when it holds an adapter there.
    pub fn find_in_dir(&self, name: &str) -> Option<PathBuf> {
        let dir = self.dir.as_ref()?;
        check_name(name).ok()?;
        let folder = dir.join(name);
        folder
            .join("adapter_config.json")
            .is_file()
            .then_some(folder)
    }
}

/// An adapter name as requests use it: not empty, and (since `--lora-dir` resolves names
/// to folders) no path separator, no `.` or `..`.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() {
        return Err("an adapter name must not be empty".into());
    }
    if name.contains(['/', '\\', '\0']) || name == "." || name == ".." {
        return Err(format!(
            "adapter name {name:?} must not contain a path separator or be . or .."
        ));
    }
    Ok(())
}

/// One `--lora-adapters` entry, `name=path`.
pub fn parse_adapter(entry: &str) -> Result<(String, PathBuf), String> {
    let (name, path) = entry
        .split_once('=')
        .ok_or_else(|| format!("{entry:?} is not name=path"))?;
    let name = name.trim();
    check_name(name)?;
    let path = path.trim();
    if path.is_empty() {
        return Err(format!("{entry:?}: the adapter's folder is empty"));
    }
    Ok((name.to_string(), Path::new(path).to_path_buf()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_entries_are_name_equals_path_with_safe_names() {
        assert_eq!(
            parse_adapter("sql=/a/sql-lora").unwrap(),
            ("sql".to_string(), PathBuf::from("/a/sql-lora"))
        );
        assert!(parse_adapter("sql").unwrap_err().contains("name=path"));
        assert!(parse_adapter("=/a").unwrap_err().contains("empty"));
        assert!(parse_adapter("x=").unwrap_err().contains("folder"));
        assert!(parse_adapter("a/b=/a").unwrap_err().contains("separator"));
        assert!(check_name("..").is_err() && check_name("ok-1.2").is_ok());
    }

    #[test]
    fn the_lora_dir_finds_folders_holding_an_adapter_config_and_nothing_outside() {
        let root = std::env::temp_dir().join(format!("cadence-lora-dir-{}", std::process::id()));
        std::fs::create_dir_all(root.join("dir/good")).unwrap();
        std::fs::create_dir_all(root.join("dir/empty")).unwrap();
        std::fs::write(root.join("dir/good/adapter_config.json"), "{}").unwrap();
        std::fs::write(root.join("adapter_config.json"), "{}").unwrap();
        let config = LoraConfig {
            dir: Some(root.join("dir")),
            ..Default::default()
        };
        assert!(config.enabled());
        assert_eq!(config.find_in_dir("good"), Some(root.join("dir/good")));
        assert_eq!(config.find_in_dir("empty"), None);
        assert_eq!(config.find_in_dir("missing"), None);
        assert_eq!(config.find_in_dir(".."), None); // root/adapter_config.json exists
        assert!(!LoraConfig::default().enabled());
        std::fs::remove_dir_all(root).unwrap();
    }
}
