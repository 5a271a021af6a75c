//! `--lora-adapter NAME[=BASE]`: the LoRA adapters the workers serve, and each one's
//! base model.

use std::collections::BTreeMap;
use std::mem::take;

use super::{ConfigError, FileConfig, ServeArgs, flag_or_file};

/// The most LoRA adapters named.
const MAX_LORA_ADAPTERS: usize = 4096;

/// `--lora-adapter NAME[=BASE]`: each adapter's base model (default `--model`'s).
pub(super) fn adapters(
    a: &mut ServeArgs,
    f: &mut FileConfig,
) -> Result<BTreeMap<String, String>, ConfigError> {
    let given = flag_or_file(take(&mut a.lora_adapters), take(&mut f.lora_adapters));
    if given.len() > MAX_LORA_ADAPTERS {
        return Err(ConfigError(format!(
            "--lora-adapter: {} adapters, more than {MAX_LORA_ADAPTERS}",
            given.len()
        )));
    }
    let model = a
        .model
        .clone()
        .or(f.model.clone())
        .unwrap_or_else(|| "mock-model".into());
    let mut out = BTreeMap::new();
    for entry in given {
        let (name, base) = match entry.split_once('=') {
            Some((n, b)) => (n.trim(), b.trim()),
            None => (entry.trim(), model.as_str()),
        };
        if name.is_empty() || base.is_empty() || name.len() > 256 || base.len() > 256 {
            return Err(ConfigError(format!(
                "--lora-adapter `{entry}`: NAME or NAME=BASE_MODEL, each 1 to 256 bytes"
            )));
        }
        if name == base {
            return Err(ConfigError(format!(
                "--lora-adapter `{entry}`: an adapter is not its own base model"
            )));
        }
        if out.insert(name.to_string(), base.to_string()).is_some() {
            return Err(ConfigError(format!(
                "--lora-adapter: `{name}` is named twice"
            )));
        }
    }
    if let Some((name, _)) = out.iter().find(|(n, _)| out.values().any(|b| b == *n)) {
        return Err(ConfigError(format!(
            "--lora-adapter: `{name}` is both an adapter and a base model"
        )));
    }
    Ok(out)
}
