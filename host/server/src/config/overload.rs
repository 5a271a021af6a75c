//! The overload settings: saturation thresholds, the queue's bounds, priority classes
//! and tenants (flags for the bounds and thresholds; classes and tenants in the file).

use std::time::Duration;

use serde::Deserialize;

use super::{ConfigError, bounded};
use crate::queue::classes::{
    Class, MAX_OBJECTIVE_MS, OverloadConfig, Tenant, builtin_classes, objective_ms,
};
use switchyard_router::{Objectives, Saturation};

/// A `[[classes]]` table: a priority class added to (or replacing one of) `high`,
/// `normal` and `low`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ClassTable {
    name: String,
    rank: u32,
    deadline_ms: u64,
    /// Its requests' time-to-first-token objective, unless their header sets one.
    #[serde(default)]
    ttft_ms: Option<u64>,
    /// Its requests' time-per-output-token objective, unless their header sets one.
    #[serde(default)]
    tpot_ms: Option<u64>,
}

/// A `[[tenants]]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct TenantTable {
    name: String,
    #[serde(default)]
    weight: Option<u32>,
    /// Hex SHA-256 of the tenant's API key (never the key itself in a file).
    #[serde(default)]
    api_key_sha256: Option<String>,
    #[serde(default)]
    class: Option<String>,
    /// The most urgent class its requests may ask for (default: `class`).
    #[serde(default)]
    max_class: Option<String>,
}

/// The raw values, flag beating file.
pub(crate) struct Raw {
    pub queue_max: Option<usize>,
    pub queue_max_bytes: Option<usize>,
    pub saturation_queued: Option<u32>,
    pub saturation_kv_usage: Option<f32>,
    pub saturation_max_in_flight: Option<u32>,
    pub saturation_prefill_tokens: Option<u64>,
    pub saturation_wait_ms: Option<u64>,
    pub saturation_batch_full: Option<bool>,
    pub tenant_header: Option<String>,
    pub classes: Vec<ClassTable>,
    pub tenants: Vec<TenantTable>,
}

/// Most classes and tenants the file may name: each is a row scanned per request.
const MAX_CLASSES: usize = 16;
const MAX_TENANTS: usize = 1024;

pub(crate) fn resolve(raw: Raw) -> Result<(OverloadConfig, Saturation), ConfigError> {
    let d = OverloadConfig::default();
    let s = Saturation::default();
    let kv_usage = raw.saturation_kv_usage.unwrap_or(s.kv_usage);
    if kv_usage.is_nan() || kv_usage <= 0.0 {
        return Err(ConfigError(format!(
            "saturation_kv_usage = {kv_usage}: a share above 0 (above 1 turns it off)"
        )));
    }
    let saturation = Saturation {
        queued: raw.saturation_queued.unwrap_or(s.queued),
        kv_usage,
        max_in_flight: raw.saturation_max_in_flight.unwrap_or(s.max_in_flight),
        prefill_tokens: raw.saturation_prefill_tokens.unwrap_or(s.prefill_tokens),
        wait: bounded(
            "saturation_wait_ms",
            raw.saturation_wait_ms,
            Duration::from_millis,
            s.wait,
        )?,
        batch_full: raw.saturation_batch_full.unwrap_or(s.batch_full),
    };
    let mut classes = builtin_classes();
    if raw.classes.len() > MAX_CLASSES {
        return Err(ConfigError(format!(
            "{} classes: at most {MAX_CLASSES}",
            raw.classes.len()
        )));
    }
    for c in raw.classes {
        if c.name.is_empty() || c.name.len() > 64 || !c.name.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(ConfigError(format!(
                "class `{}`: a name of 1 to 64 printable ASCII characters",
                c.name
            )));
        }
        let objective = |what: &str, ms: Option<u64>| -> Result<Option<Duration>, ConfigError> {
            ms.map(|ms| {
                objective_ms(ms).ok_or_else(|| {
                    ConfigError(format!(
                        "class `{}` {what} = {ms}: 1 to {MAX_OBJECTIVE_MS} milliseconds",
                        c.name
                    ))
                })
            })
            .transpose()
        };
        let objectives = Objectives {
            ttft: objective("ttft_ms", c.ttft_ms)?,
            tpot: objective("tpot_ms", c.tpot_ms)?,
        };
        let class = Class {
            deadline: bounded(
                &format!("class `{}` deadline_ms", c.name),
                Some(c.deadline_ms),
                Duration::from_millis,
                Duration::ZERO,
            )?,
            name: c.name,
            rank: c.rank,
            objectives,
        };
        match classes.iter_mut().find(|k| k.name == class.name) {
            Some(k) => *k = class,
            None => classes.push(class),
        }
    }
    classes.sort_by_key(|c| c.rank);
    if raw.tenants.len() > MAX_TENANTS {
        return Err(ConfigError(format!(
            "{} tenants: at most {MAX_TENANTS}",
            raw.tenants.len()
        )));
    }
    let mut tenants = Vec::new();
    for t in raw.tenants {
        for c in [&t.class, &t.max_class].into_iter().flatten() {
            if !classes.iter().any(|k| &k.name == c) {
                return Err(ConfigError(format!("tenant `{}`: no class `{c}`", t.name)));
            }
        }
        if t.name == crate::queue::classes::DEFAULT_TENANT {
            return Err(ConfigError(format!(
                "tenant `{}`: the name of the tenant of requests no configured tenant claims",
                t.name
            )));
        }
        let api_key_sha256 = match &t.api_key_sha256 {
            None => None,
            Some(h) => Some(parse_sha256(h).ok_or_else(|| {
                ConfigError(format!(
                    "tenant `{}`: api_key_sha256 must be 64 hex digits (`printf %s KEY | sha256sum`)",
                    t.name
                ))
            })?),
        };
        if tenants.iter().any(|k: &Tenant| k.name == t.name) {
            return Err(ConfigError(format!("tenant `{}` is named twice", t.name)));
        }
        tenants.push(Tenant {
            weight: match t.weight {
                Some(0) => {
                    return Err(ConfigError(format!(
                        "tenant `{}`: weight 0 would never be served",
                        t.name
                    )));
                }
                Some(w) => w.min(1_000_000),
                None => 1,
            },
            name: t.name,
            api_key_sha256,
            class: t.class,
            max_class: t.max_class,
        });
    }
    let overload = OverloadConfig {
        queue_max: raw.queue_max.unwrap_or(d.queue_max),
        queue_max_bytes: raw.queue_max_bytes.unwrap_or(d.queue_max_bytes),
        classes,
        tenants,
        tenant_header: match raw.tenant_header {
            Some(h) => {
                hyper::header::HeaderName::from_bytes(h.as_bytes()).map_err(|_| {
                    ConfigError(format!("tenant_header `{h}` is not a header name"))
                })?;
                h.to_ascii_lowercase()
            }
            None => d.tenant_header,
        },
    };
    Ok((overload, saturation))
}

fn parse_sha256(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.trim();
    if hex.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, b) in out.iter_mut().enumerate() {
        *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}
