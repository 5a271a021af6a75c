//! Who a request is and how urgent, from what the operator trusts: its tenant is the
//! configured tenant whose API key it carries, or the keyless configured tenant its
//! tenant header names (a header a trusted gateway sets), else the one shared tenant
//! [`DEFAULT_TENANT`] — a name no configured tenant has, or a key no tenant holds, makes
//! no tenant of its own. Its class is what `x-switchyard-priority` asks, never more
//! urgent than its tenant's cap (`max_class`, else its class; `normal` for the default
//! tenant): a client may lower its priority, not raise it. Its queue deadline is
//! `x-switchyard-deadline-ms`, or its class's; its latency objectives are
//! `x-slo-ttft-ms` and `x-slo-tpot-ms` (llm-d's names), or its class's. An objective
//! constrains only the request that carries it (it is placed where it would be met, or
//! refused when it would be met nowhere), so a client may set any.

use std::sync::Arc;
use std::time::Duration;

use hyper::HeaderMap;
use hyper::header::AUTHORIZATION;
use sha2::{Digest, Sha256};
use switchyard_router::Objectives;

/// The header naming a request's priority class.
pub const PRIORITY_HEADER: &str = "x-switchyard-priority";
/// The header giving the longest a request may wait in the router's queue, ms.
pub const DEADLINE_HEADER: &str = "x-switchyard-deadline-ms";
/// The header naming a request's tenant, unless the configuration names another.
pub const TENANT_HEADER: &str = "x-switchyard-tenant";
/// The tenant of every request no configured tenant claims.
pub const DEFAULT_TENANT: &str = "anonymous";
/// The header giving a request's time-to-first-token objective, ms.
pub const TTFT_OBJECTIVE_HEADER: &str = "x-slo-ttft-ms";
/// The header giving a request's time-per-output-token objective, ms.
pub const TPOT_OBJECTIVE_HEADER: &str = "x-slo-tpot-ms";
/// The longest objective a header may set, ms (an hour).
pub const MAX_OBJECTIVE_MS: u64 = 3_600_000;

/// A priority class: every queued request of a lower `rank` is dispatched before any
/// of a higher one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Class {
    /// Its name, as the priority header says it.
    pub name: String,
    /// Dispatch order: lower first.
    pub rank: u32,
    /// The longest its requests wait in the queue unless their header says otherwise.
    pub deadline: Duration,
    /// Its requests' latency objectives unless their headers say otherwise.
    pub objectives: Objectives,
}

/// A tenant the configuration knows: its weight in the fair share, how its API key is
/// recognised, and its default class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant {
    /// Its name (the tenant header's value, or what its API key maps to).
    pub name: String,
    /// Its share of the queue relative to other tenants' (default 1).
    pub weight: u32,
    /// SHA-256 of its API key (the bearer token), if requests name it that way.
    pub api_key_sha256: Option<[u8; 32]>,
    /// The class of its requests that name none.
    pub class: Option<String>,
    /// The most urgent class its requests may ask for (a more urgent one gets this);
    /// by default its `class`.
    pub max_class: Option<String>,
}

/// How the router behaves past its fleet's capacity.
#[derive(Debug, Clone, PartialEq)]
pub struct OverloadConfig {
    /// Most requests waiting per endpoint (0: no queue; saturated workers are then only
    /// avoided, and a fleet saturated everywhere takes requests as before).
    pub queue_max: usize,
    /// Most bytes of request bodies waiting per endpoint.
    pub queue_max_bytes: usize,
    /// The classes, ascending by rank.
    pub classes: Vec<Class>,
    /// Known tenants.
    pub tenants: Vec<Tenant>,
    /// The header naming the tenant.
    pub tenant_header: String,
}

impl Default for OverloadConfig {
    fn default() -> Self {
        OverloadConfig {
            queue_max: 1024,
            queue_max_bytes: 256 << 20,
            classes: builtin_classes(),
            tenants: Vec::new(),
            tenant_header: TENANT_HEADER.into(),
        }
    }
}

/// `high`, `normal` and `low`: 10 s, 60 s and 300 s of queue deadline.
pub fn builtin_classes() -> Vec<Class> {
    [("high", 0, 10), ("normal", 1, 60), ("low", 2, 300)]
        .into_iter()
        .map(|(name, rank, secs)| Class {
            name: name.into(),
            rank,
            deadline: Duration::from_secs(secs),
            objectives: Objectives::default(),
        })
        .collect()
}

/// Who a request is, resolved from its headers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Index into [`OverloadConfig::classes`].
    pub class: usize,
    /// The tenant key.
    pub tenant: Arc<str>,
    /// Its weight.
    pub weight: u32,
    /// Longest wait in the queue.
    pub deadline: Duration,
    /// Its latency objectives.
    pub objectives: Objectives,
    /// A configured tenant (not [`DEFAULT_TENANT`]): only such a request makes room in a
    /// full queue by taking a place held over its share.
    pub known: bool,
}

impl OverloadConfig {
    /// The index of the class named `name`.
    pub fn class_index(&self, name: &str) -> Option<usize> {
        self.classes.iter().position(|c| c.name == name)
    }

    /// The request's class, tenant and deadline, or why its headers are refused (an
    /// unknown class, a malformed deadline). A deadline is capped at `longest`.
    pub fn identify(&self, headers: &HeaderMap, longest: Duration) -> Result<Identity, String> {
        let tenant = self.tenant_of(headers);
        let named = |c: Option<&String>| c.and_then(|c| self.class_index(c));
        let normal = self.class_index("normal").unwrap_or(0);
        let default = tenant
            .and_then(|t| named(t.class.as_ref()))
            .unwrap_or(normal);
        // Classes are in dispatch order: a larger index is less urgent.
        let cap = tenant
            .and_then(|t| named(t.max_class.as_ref()))
            .unwrap_or(default)
            .min(default);
        let class = match headers.get(PRIORITY_HEADER) {
            Some(v) => {
                let name = v
                    .to_str()
                    .map_err(|_| format!("{PRIORITY_HEADER} is not text"))?;
                let asked = self.class_index(name.trim()).ok_or_else(|| {
                    let known: Vec<&str> = self.classes.iter().map(|c| c.name.as_str()).collect();
                    format!(
                        "{PRIORITY_HEADER}: no class `{}` (classes: {})",
                        name.chars().take(64).collect::<String>(),
                        known.join(", ")
                    )
                })?;
                asked.max(cap)
            }
            None => default,
        };
        let deadline = match header_ms(headers, DEADLINE_HEADER)? {
            Some(ms) => Duration::from_millis(ms),
            None => self.classes.get(class).map_or(longest, |c| c.deadline),
        }
        .min(longest);
        let objective = |name: &str| -> Result<Option<Duration>, String> {
            header_ms(headers, name)?
                .map(|ms| {
                    objective_ms(ms).ok_or_else(|| {
                        format!("{name} must be 1 to {MAX_OBJECTIVE_MS} milliseconds")
                    })
                })
                .transpose()
        };
        let class_objectives = self
            .classes
            .get(class)
            .map(|c| c.objectives)
            .unwrap_or_default();
        let objectives = Objectives {
            ttft: objective(TTFT_OBJECTIVE_HEADER)?.or(class_objectives.ttft),
            tpot: objective(TPOT_OBJECTIVE_HEADER)?.or(class_objectives.tpot),
        };
        let (name, weight) = match tenant {
            Some(t) => (Arc::from(t.name.as_str()), t.weight.max(1)),
            None => (Arc::from(DEFAULT_TENANT), 1),
        };
        Ok(Identity {
            class,
            tenant: name,
            weight,
            deadline,
            objectives,
            known: tenant.is_some(),
        })
    }

    /// The configured tenant the request is: the one its API key belongs to, else the
    /// one its tenant header names if that tenant has no key (a tenant with a key is
    /// that key's alone: naming it by header without the key does not make a request
    /// it).
    fn tenant_of(&self, headers: &HeaderMap) -> Option<&Tenant> {
        if let Some(key) = bearer(headers) {
            let digest: [u8; 32] = Sha256::digest(key.as_bytes()).into();
            if let Some(t) = self
                .tenants
                .iter()
                .find(|t| t.api_key_sha256 == Some(digest))
            {
                return Some(t);
            }
        }
        let name = headers
            .get(self.tenant_header.as_str())
            .and_then(|v| v.to_str().ok())?
            .trim();
        self.tenants
            .iter()
            .find(|t| t.name == name && t.api_key_sha256.is_none())
    }
}

/// A latency objective of `ms` milliseconds, if it is one: 1 ms to an hour.
pub fn objective_ms(ms: u64) -> Option<Duration> {
    (1..=MAX_OBJECTIVE_MS)
        .contains(&ms)
        .then(|| Duration::from_millis(ms))
}

/// A header's whole number of milliseconds, if the request has it.
fn header_ms(headers: &HeaderMap, name: &str) -> Result<Option<u64>, String> {
    let Some(v) = headers.get(name) else {
        return Ok(None);
    };
    v.to_str()
        .ok()
        .filter(|s| s.len() <= 12)
        .and_then(|s| s.trim().parse().ok())
        .map(Some)
        .ok_or_else(|| format!("{name} must be a whole number of milliseconds"))
}

/// The bearer token of `Authorization`, if any.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    let v = headers.get(AUTHORIZATION)?.to_str().ok()?;
    let token = v
        .strip_prefix("Bearer ")
        .or_else(|| v.strip_prefix("bearer "))?;
    Some(token.trim()).filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, v.parse().unwrap());
        }
        h
    }

    fn tenant(name: &str, weight: u32, key: Option<&[u8]>, class: Option<&str>) -> Tenant {
        Tenant {
            name: name.into(),
            weight,
            api_key_sha256: key.map(|k| Sha256::digest(k).into()),
            class: class.map(Into::into),
            max_class: None,
        }
    }

    fn class_of(config: &OverloadConfig, h: &[(&'static str, &str)]) -> String {
        let who = config
            .identify(&headers(h), Duration::from_secs(600))
            .unwrap();
        config.classes[who.class].name.clone()
    }

    #[test]
    fn requests_are_identified_by_their_headers_and_keys() {
        let config = OverloadConfig {
            tenants: vec![tenant("nightly", 3, Some(b"sk-batch"), Some("low"))],
            ..OverloadConfig::default()
        };
        let long = Duration::from_secs(600);
        let plain = config.identify(&HeaderMap::new(), long).unwrap();
        assert_eq!(config.classes[plain.class].name, "normal");
        assert_eq!((&*plain.tenant, plain.known), (DEFAULT_TENANT, false));
        assert_eq!(plain.deadline, Duration::from_secs(60));

        let by_key = config
            .identify(&headers(&[("authorization", "Bearer sk-batch")]), long)
            .unwrap();
        assert_eq!(
            (&*by_key.tenant, by_key.weight, by_key.class, by_key.known),
            ("nightly", 3, 2, true)
        );
        let lower = config
            .identify(
                &headers(&[(DEADLINE_HEADER, "1500"), (PRIORITY_HEADER, "low")]),
                long,
            )
            .unwrap();
        assert_eq!(
            (lower.class, lower.deadline),
            (2, Duration::from_millis(1500))
        );
        let capped = config
            .identify(&headers(&[(DEADLINE_HEADER, "99999999")]), long)
            .unwrap();
        assert_eq!(capped.deadline, long);

        let err = config
            .identify(&headers(&[(PRIORITY_HEADER, "urgent")]), long)
            .unwrap_err();
        assert!(err.contains("high, normal, low"), "{err}");
        assert!(
            config
                .identify(&headers(&[(DEADLINE_HEADER, "-5")]), long)
                .is_err()
        );
        assert!(
            config
                .identify(&headers(&[(DEADLINE_HEADER, "1e400")]), long)
                .is_err()
        );
    }

    /// A request's objectives are its headers', else its class's; an objective outside
    /// 1 ms to an hour, or not a number, is the client's error, said plainly.
    #[test]
    fn objectives_come_from_headers_else_the_class() {
        let mut config = OverloadConfig::default();
        let low = config.class_index("low").unwrap();
        config.classes[low].objectives = Objectives {
            ttft: Some(Duration::from_millis(900)),
            tpot: None,
        };
        let long = Duration::from_secs(600);
        let of = |h: &[(&'static str, &str)]| config.identify(&headers(h), long);
        assert_eq!(of(&[]).unwrap().objectives, Objectives::default());
        let own = of(&[
            (TTFT_OBJECTIVE_HEADER, "150"),
            (TPOT_OBJECTIVE_HEADER, "40"),
        ])
        .unwrap();
        assert_eq!(
            own.objectives,
            Objectives {
                ttft: Some(Duration::from_millis(150)),
                tpot: Some(Duration::from_millis(40)),
            }
        );
        let class = of(&[(PRIORITY_HEADER, "low"), (TPOT_OBJECTIVE_HEADER, "40")]).unwrap();
        assert_eq!(class.objectives.ttft, Some(Duration::from_millis(900)));
        assert_eq!(class.objectives.tpot, Some(Duration::from_millis(40)));
        for bad in ["0", "3600001", "soon", "-1"] {
            let err = of(&[(TTFT_OBJECTIVE_HEADER, bad)]).unwrap_err();
            assert!(err.contains(TTFT_OBJECTIVE_HEADER), "{bad}: {err}");
        }
    }

    /// Nothing a client sends makes it more urgent than its tenant may be: `high`
    /// without the right is its tenant's class; lowering is always allowed; a tenant's
    /// `max_class` is the most it may ask for.
    #[test]
    fn a_client_cannot_raise_its_priority_past_its_tenants_cap() {
        let mut search = tenant("search", 1, None, None);
        search.max_class = Some("high".into());
        let config = OverloadConfig {
            tenants: vec![tenant("nightly", 1, Some(b"sk-batch"), Some("low")), search],
            ..OverloadConfig::default()
        };
        assert_eq!(class_of(&config, &[(PRIORITY_HEADER, "high")]), "normal");
        assert_eq!(
            class_of(
                &config,
                &[
                    (PRIORITY_HEADER, "high"),
                    ("authorization", "Bearer sk-batch")
                ]
            ),
            "low",
            "a batch tenant's key cannot ask for more than its class"
        );
        assert_eq!(
            class_of(
                &config,
                &[
                    (PRIORITY_HEADER, "normal"),
                    ("authorization", "Bearer sk-batch")
                ]
            ),
            "low"
        );
        assert_eq!(class_of(&config, &[(PRIORITY_HEADER, "low")]), "low");
        assert_eq!(class_of(&config, &[(TENANT_HEADER, "search")]), "normal");
        assert_eq!(
            class_of(
                &config,
                &[(TENANT_HEADER, "search"), (PRIORITY_HEADER, "high")]
            ),
            "high",
            "its max_class allows it"
        );
    }

    /// Names and keys no configured tenant has are all the one default tenant: a client
    /// cannot give itself a share by inventing them.
    #[test]
    fn invented_tenants_are_the_one_default_tenant() {
        let config = OverloadConfig {
            tenants: vec![tenant("nightly", 3, Some(b"sk-batch"), Some("low"))],
            ..OverloadConfig::default()
        };
        let long = Duration::from_secs(600);
        for h in [
            vec![(TENANT_HEADER, "search")],
            vec![(TENANT_HEADER, "tenant-917")],
            vec![("authorization", "Bearer sk-random-1")],
            vec![
                (TENANT_HEADER, "x"),
                ("authorization", "Bearer sk-random-2"),
            ],
        ] {
            let who = config.identify(&headers(&h), long).unwrap();
            assert_eq!(
                (&*who.tenant, who.weight, who.known),
                (DEFAULT_TENANT, 1, false),
                "{h:?}"
            );
        }
    }

    /// A tenant with an API key is that key's: a client naming it in the tenant header
    /// without the key is not it (nor shares its place under its name), and the key
    /// wins over a header naming another tenant; a tenant without a key is named by the
    /// header (as a trusted gateway sets it).
    #[test]
    fn a_client_cannot_impersonate_a_tenant_that_has_a_key() {
        let config = OverloadConfig {
            tenants: vec![
                tenant("app", 4, Some(b"sk-app"), Some("high")),
                tenant("gateway-team", 2, None, None),
            ],
            ..OverloadConfig::default()
        };
        let long = Duration::from_secs(600);
        let forged = config
            .identify(&headers(&[(TENANT_HEADER, "app")]), long)
            .unwrap();
        assert_ne!(&*forged.tenant, "app", "the header alone is not the tenant");
        assert_eq!((&*forged.tenant, forged.weight), (DEFAULT_TENANT, 1));
        assert_eq!(config.classes[forged.class].name, "normal", "nor its class");
        let with_key = config
            .identify(
                &headers(&[
                    (TENANT_HEADER, "gateway-team"),
                    ("authorization", "Bearer sk-app"),
                ]),
                long,
            )
            .unwrap();
        assert_eq!(
            (&*with_key.tenant, with_key.weight),
            ("app", 4),
            "the key wins"
        );
        assert_eq!(config.classes[with_key.class].name, "high");
        let named = config
            .identify(&headers(&[(TENANT_HEADER, "gateway-team")]), long)
            .unwrap();
        assert_eq!((&*named.tenant, named.weight), ("gateway-team", 2));
        let wrong_key = config
            .identify(
                &headers(&[(TENANT_HEADER, "app"), ("authorization", "Bearer sk-guess")]),
                long,
            )
            .unwrap();
        assert_eq!(&*wrong_key.tenant, DEFAULT_TENANT);
    }
}
