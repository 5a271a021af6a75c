//! Fleet-wide policy distribution through etcd: `switchyard policy push` stores a policy
//! under `{root}/policies/{namespace}/{component}/{endpoint}`; every router replica
//! watches that prefix and swaps the endpoint's policy (after its own validation).
//! `policy push --shadow` stores a shadow under `{root}/shadows/...` the same way (its
//! entry carries `"sample"`); replicas attach it beside the live policy.
//!
//! The value is JSON: `{"sha256", "config", "wasm_base64", "pushed_at"}`, and with
//! `--sign` also `"signer"` and `"signature"` (see [`super::signing`]): an ed25519
//! signature of [`PushedPolicy::signed_message`], which names the endpoint, the policy's
//! sha256, the configuration's sha256 and the push time. etcd refuses
//! requests over 1.5 MiB by default, so a larger policy is stored in chunks, content
//! addressed: its base64 text in pieces of at most [`CHUNK_BYTES`] under
//! `{root}/policy-blobs/{sha256}/{i}`, written before the entry, which then carries
//! `"chunks": N` and no inline bytes. A replica reads the chunks, and the sha256 check of
//! [`PushedPolicy::wasm`] verifies the whole before anything loads it. Each push deletes
//! the blobs no entry refers to any more, so they do not accumulate.

use base64::Engine as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::etcd::EtcdConfig;
use super::etcd_api::Event;
use super::signing::{PublicKey, SigningKey};
use super::{DiscoveryError, EndpointPath};

/// A policy stored in etcd.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PushedPolicy {
    /// sha256 of the `.wasm`, hex.
    pub sha256: String,
    /// The operator configuration (JSON text).
    pub config: String,
    /// The `.wasm` bytes, base64.
    pub wasm_base64: String,
    /// Unix seconds when it was pushed.
    pub pushed_at: u64,
    /// Stored in this many chunks beside the entry (0: inline in `wasm_base64`).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub chunks: u32,
    /// The `.wasm`'s size in bytes, covered by the signature: a reader checks the chunk
    /// count against it before reading any chunk. Absent in pushes made before it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub size: Option<u64>,
    /// The public key that signed the push (base64), if signed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signer: Option<String>,
    /// The ed25519 signature of [`PushedPolicy::signed_message`] (base64), if signed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub signature: Option<String>,
    /// Set on a shadow push (stored under `{root}/shadows/`): the share of decisions the
    /// shadow is offered. A live push has none.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample: Option<f64>,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// Largest piece of a policy's base64 text stored in one etcd value.
pub const CHUNK_BYTES: usize = 1 << 20;

/// Most chunks a pushed policy may have: 128 MiB of base64, 96 MiB of `.wasm` (a Python
/// policy built by componentize-py is ~40 MiB). A push claiming more is refused before
/// any chunk is read.
pub const MAX_CHUNKS: u32 = 128;

impl PushedPolicy {
    /// Wraps `wasm` and `config` for storage.
    pub fn new(wasm: &[u8], config: &str) -> PushedPolicy {
        PushedPolicy {
            sha256: hex(&Sha256::digest(wasm)),
            config: config.to_string(),
            wasm_base64: base64::engine::general_purpose::STANDARD.encode(wasm),
            pushed_at: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            chunks: 0,
            size: Some(wasm.len() as u64),
            signer: None,
            signature: None,
            sample: None,
        }
    }

    /// Wraps `wasm` and `config` as a shadow offered a `sample` share of the decisions.
    pub fn shadow(wasm: &[u8], config: &str, sample: f64) -> PushedPolicy {
        PushedPolicy {
            sample: Some(sample),
            ..PushedPolicy::new(wasm, config)
        }
    }

    /// Which prefix the push belongs under.
    pub fn role(&self) -> Role {
        if self.sample.is_some() {
            Role::Shadow
        } else {
            Role::Live
        }
    }

    /// What a signature covers: the endpoint (a push signed for one endpoint is no good
    /// for another), the policy's and the configuration's sha256, the push time and the
    /// policy's size (v2; a push without a size, made before it, is signed as v1).
    /// A shadow push's message says so (and its sample): a signed live push cannot be
    /// stored as a shadow, nor a shadow as the live policy.
    pub fn signed_message(&self, endpoint: &EndpointPath) -> Vec<u8> {
        let mut m = format!(
            "switchyard-policy-push-{}\n{endpoint}\n{}\n{}\n{}\n",
            if self.size.is_some() { "v2" } else { "v1" },
            self.sha256,
            hex(&Sha256::digest(self.config.as_bytes())),
            self.pushed_at
        );
        if let Some(size) = self.size {
            m.push_str(&format!("{size}\n"));
        }
        if let Some(sample) = self.sample {
            m.push_str(&format!("shadow\n{sample}\n"));
        }
        m.into_bytes()
    }

    /// Signs the push for `endpoint`.
    pub fn sign(&mut self, endpoint: &EndpointPath, key: &SigningKey) {
        let b64 = base64::engine::general_purpose::STANDARD;
        self.signature = Some(b64.encode(key.sign(&self.signed_message(endpoint))));
        self.signer = Some(key.public().to_string());
    }

    /// Checks the push against the keys a router trusts: with none, anything goes; with
    /// some, it must be signed for `endpoint` by one of them. Says why not.
    pub fn verify(&self, endpoint: &EndpointPath, trusted: &[PublicKey]) -> Result<(), String> {
        if trusted.is_empty() {
            return Ok(());
        }
        let (Some(signer), Some(signature)) = (&self.signer, &self.signature) else {
            return Err(format!(
                "the push is not signed, and this router applies only pushes signed by one \
                 of its {} trusted keys",
                trusted.len()
            ));
        };
        let signer: PublicKey = signer
            .parse()
            .map_err(|e| format!("the push's signer is not a key: {e}"))?;
        if !trusted.contains(&signer) {
            return Err(format!(
                "the push is signed by {signer}, a key this router does not trust"
            ));
        }
        let signature = base64::engine::general_purpose::STANDARD
            .decode(signature)
            .map_err(|e| format!("the push's signature is not base64: {e}"))?;
        if !signer.verifies(&self.signed_message(endpoint), &signature) {
            return Err(
                "the push's signature does not verify (altered after signing, or signed for \
                 another endpoint)"
                    .into(),
            );
        }
        Ok(())
    }

    /// The `.wasm` bytes, checked against `sha256`.
    pub fn wasm(&self) -> Result<Vec<u8>, String> {
        let bytes = base64::engine::general_purpose::STANDARD
            .decode(&self.wasm_base64)
            .map_err(|e| format!("wasm_base64 is not base64: {e}"))?;
        if hex(&Sha256::digest(&bytes)) != self.sha256 {
            return Err("the policy bytes do not match their sha256".into());
        }
        Ok(bytes)
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Live policies or shadows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// `{root}/policies/`: the policy that serves.
    Live,
    /// `{root}/shadows/`: a policy that decides beside it without serving.
    Shadow,
}

fn prefix(root: &str, role: Role) -> String {
    let dir = match role {
        Role::Live => "policies",
        Role::Shadow => "shadows",
    };
    format!("{}/{dir}/", root.trim_end_matches('/'))
}

fn blobs(root: &str) -> String {
    format!("{}/policy-blobs/", root.trim_end_matches('/'))
}

/// Stores `policy` for `endpoint` (in chunks when it is large), as the live policy or,
/// with a `sample`, as the shadow; returns the key written.
pub async fn push(
    config: &EtcdConfig,
    endpoint: &EndpointPath,
    policy: &PushedPolicy,
) -> Result<String, DiscoveryError> {
    let api = config.api();
    let key = format!("{}{endpoint}", prefix(&config.root, policy.role()));
    let mut entry = policy.clone();
    if entry.wasm_base64.len() > CHUNK_BYTES {
        // Base64 is ASCII: any byte offset is a character boundary.
        let pieces: Vec<&[u8]> = entry.wasm_base64.as_bytes().chunks(CHUNK_BYTES).collect();
        for (i, piece) in pieces.iter().enumerate() {
            let blob = format!("{}{}/{i:06}", blobs(&config.root), entry.sha256);
            api.put(&blob, piece, None).await?;
        }
        entry.chunks = u32::try_from(pieces.len()).unwrap_or(u32::MAX);
        entry.wasm_base64 = String::new();
    }
    let value = serde_json::to_string(&entry).expect("policies serialise");
    api.put(&key, value.as_bytes(), None).await?;
    collect_garbage(config).await?;
    Ok(key)
}

/// Deletes the chunks of policies no entry refers to.
async fn collect_garbage(config: &EtcdConfig) -> Result<(), DiscoveryError> {
    let api = config.api();
    let (mut entries, _) = api.range_prefix(&prefix(&config.root, Role::Live)).await?;
    entries.extend(
        api.range_prefix(&prefix(&config.root, Role::Shadow))
            .await?
            .0,
    );
    let referenced: std::collections::HashSet<String> = entries
        .iter()
        .filter_map(|kv| serde_json::from_slice::<PushedPolicy>(&kv.value).ok())
        .map(|p| p.sha256)
        .collect();
    let stored = api.keys_with_prefix(&blobs(&config.root)).await?;
    let mut unused: Vec<String> = stored
        .iter()
        .filter_map(|kv| {
            let key = String::from_utf8_lossy(&kv.key);
            let sha = key.strip_prefix(&blobs(&config.root))?.split('/').next()?;
            (!referenced.contains(sha)).then(|| sha.to_string())
        })
        .collect();
    unused.dedup();
    for sha in unused {
        api.delete(&format!("{}{sha}/", blobs(&config.root)), true)
            .await?;
    }
    Ok(())
}

/// The length of `size` bytes in padded base64.
fn base64_len(size: u64) -> u64 {
    size.div_ceil(3).saturating_mul(4)
}

/// Fills in a chunked policy's bytes from its blobs (a missing or extra chunk leaves it
/// unverifiable, and [`PushedPolicy::wasm`] refuses it). Bounded before anything is read:
/// at most [`MAX_CHUNKS`] chunks of at most [`CHUNK_BYTES`] each.
async fn resolve(config: &EtcdConfig, mut policy: PushedPolicy) -> Result<PushedPolicy, String> {
    if policy.chunks == 0 {
        return Ok(policy);
    }
    if policy.chunks > MAX_CHUNKS {
        return Err(format!(
            "policy {} claims {} chunks; at most {MAX_CHUNKS} are read",
            policy.sha256, policy.chunks
        ));
    }
    // With a size (signed, where keys are trusted), the chunks must be exactly what it
    // takes, and no more text is read than its base64 holds.
    let text_len = policy.size.map(base64_len);
    if let Some((size, len)) = policy.size.zip(text_len) {
        let needed = len.div_ceil(CHUNK_BYTES as u64);
        if u64::from(policy.chunks) != needed {
            return Err(format!(
                "policy {} claims {} chunks, but its {size} bytes take {needed}",
                policy.sha256, policy.chunks
            ));
        }
    }
    // The keys first, then one chunk per call: each answer stays ~1 MiB, whatever the
    // policy's size, so every read fits the etcd timeout.
    let api = config.api();
    let mut keys = api
        .keys_with_prefix(&format!("{}{}/", blobs(&config.root), policy.sha256))
        .await
        .map_err(|e| format!("cannot list the policy's chunks: {e}"))?;
    if keys.len() != policy.chunks as usize {
        return Err(format!(
            "policy {} has {} of its {} chunks",
            policy.sha256,
            keys.len(),
            policy.chunks
        ));
    }
    keys.sort_by(|a, b| a.key.cmp(&b.key));
    let mut text = Vec::new();
    for kv in &keys {
        let key = String::from_utf8_lossy(&kv.key);
        let (found, _) = api
            .range_prefix(&key)
            .await
            .map_err(|e| format!("cannot read chunk {key}: {e}"))?;
        let chunk = found
            .into_iter()
            .find(|c| c.key == kv.key)
            .ok_or_else(|| format!("chunk {key} is gone"))?;
        if chunk.value.len() > CHUNK_BYTES {
            return Err(format!(
                "chunk {key} holds {} bytes (at most {CHUNK_BYTES})",
                chunk.value.len()
            ));
        }
        if text_len.is_some_and(|len| (text.len() + chunk.value.len()) as u64 > len) {
            return Err(format!(
                "the chunks of policy {} exceed its size",
                policy.sha256
            ));
        }
        text.extend_from_slice(&chunk.value);
    }
    policy.wasm_base64 =
        String::from_utf8(text).map_err(|_| "a policy chunk is not base64 text".to_string())?;
    Ok(policy)
}

/// What etcd says about pushed policies.
#[derive(Debug, Clone)]
pub enum PolicyEvent {
    /// The policy stored for an endpoint (on every listing, and when pushed).
    Put(EndpointPath, PushedPolicy),
    /// The push for an endpoint was deleted.
    Delete(EndpointPath),
    /// A full listing just ended: these endpoints have a push stored, and no other does
    /// (pushes deleted while the watch was down are gone from it).
    Listed(Vec<EndpointPath>),
}

/// Calls `apply` with every stored policy now (then `Listed`), and with every push and
/// deletion later, forever: after a broken watch it reconnects with backoff and lists
/// again. Malformed entries are logged and skipped. With `trusted` keys, a push they did
/// not sign is passed on without its chunks (whose reading an etcd writer could make
/// arbitrarily costly): the signature covers the policy's sha256, not its bytes, so it
/// is checked first, and the receiver refuses the push for the same reason.
pub fn watch(
    config: EtcdConfig,
    role: Role,
    trusted: Vec<PublicKey>,
    apply: impl Fn(PolicyEvent) + Send + Sync + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut delay = config.backoff_initial;
        let ctx = Ctx {
            config: &config,
            role,
            trusted: &trusted,
        };
        loop {
            if let Err(e) = cycle(&ctx, &apply, &mut delay).await {
                tracing::warn!(error = %e, ?role, retry_in = ?delay, "policy watch interrupted");
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(config.backoff_max);
        }
    })
}

/// Deletes the push for `endpoint`: every router returns it to its configured policy
/// (or, for [`Role::Shadow`], removes its shadow). Returns whether there was one.
pub async fn remove(
    config: &EtcdConfig,
    role: Role,
    endpoint: &EndpointPath,
) -> Result<bool, DiscoveryError> {
    let api = config.api();
    let key = format!("{}{endpoint}", prefix(&config.root, role));
    let (found, _) = api.range_prefix(&key).await?;
    let existed = found.iter().any(|kv| kv.key == key.as_bytes());
    api.delete(&key, false).await?;
    collect_garbage(config).await?;
    Ok(existed)
}

fn parse(
    key: &[u8],
    value: &[u8],
    root: &str,
    role: Role,
) -> Result<(EndpointPath, PushedPolicy), String> {
    let key = String::from_utf8_lossy(key);
    let path = key
        .strip_prefix(&prefix(root, role))
        .ok_or("outside the policy prefix")?;
    let endpoint: EndpointPath = path.parse().map_err(|e: super::KeyError| e.to_string())?;
    let policy: PushedPolicy = serde_json::from_slice(value).map_err(|e| format!("{key}: {e}"))?;
    Ok((endpoint, policy))
}

/// What a policy watch needs besides its callback.
struct Ctx<'a> {
    config: &'a EtcdConfig,
    role: Role,
    trusted: &'a [PublicKey],
}

/// Parses an entry, reads its chunks if it has any (only once its signature verifies,
/// when keys are trusted), and applies it; logs what is wrong. Returns its endpoint if
/// the key names one.
async fn deliver(
    ctx: &Ctx<'_>,
    apply: &(impl Fn(PolicyEvent) + Send + Sync),
    key: &[u8],
    value: &[u8],
) -> Option<EndpointPath> {
    let (config, role) = (ctx.config, ctx.role);
    let parsed = match parse(key, value, &config.root, role) {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "skipping a malformed policy entry");
            return endpoint_of(key, &config.root, role);
        }
    };
    let endpoint = parsed.0.clone();
    if let Err(why) = parsed.1.verify(&endpoint, ctx.trusted) {
        tracing::debug!(%endpoint, why, "a pushed policy's signature does not verify; its chunks are not read");
        apply(PolicyEvent::Put(parsed.0, parsed.1));
        return Some(endpoint);
    }
    // A read that fails (a busy etcd, a chunk not yet visible) is tried three times.
    for attempt in 1..=3 {
        match resolve(config, parsed.1.clone()).await {
            Ok(policy) => {
                apply(PolicyEvent::Put(parsed.0, policy));
                break;
            }
            Err(e) if attempt < 3 => {
                tracing::debug!(error = %e, attempt, "cannot read a pushed policy yet");
                tokio::time::sleep(std::time::Duration::from_millis(500)).await;
            }
            Err(e) => tracing::warn!(error = %e, "skipping a policy whose chunks cannot be read"),
        }
    }
    Some(endpoint)
}

fn endpoint_of(key: &[u8], root: &str, role: Role) -> Option<EndpointPath> {
    String::from_utf8_lossy(key)
        .strip_prefix(&prefix(root, role))?
        .parse()
        .ok()
}

async fn cycle(
    ctx: &Ctx<'_>,
    apply: &(impl Fn(PolicyEvent) + Send + Sync),
    delay: &mut std::time::Duration,
) -> Result<(), DiscoveryError> {
    let (config, role) = (ctx.config, ctx.role);
    let api = config.api();
    let (kvs, revision) = api.range_prefix(&prefix(&config.root, role)).await?;
    let mut listed = Vec::new();
    for kv in &kvs {
        listed.extend(deliver(ctx, apply, &kv.key, &kv.value).await);
    }
    apply(PolicyEvent::Listed(listed));
    let mut watch = api
        .watch_prefix(&prefix(&config.root, role), &kvs, revision + 1)
        .await?;
    *delay = config.backoff_initial;
    loop {
        let events = watch.next_checked().await?;
        for event in events {
            match event {
                Event::Put(kv) => {
                    deliver(ctx, apply, &kv.key, &kv.value).await;
                }
                Event::Delete(kv) => {
                    if let Some(endpoint) = endpoint_of(&kv.key, &config.root, role) {
                        apply(PolicyEvent::Delete(endpoint));
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_size_says_how_many_chunks_its_base64_takes() {
        assert_eq!(base64_len(0), 0);
        assert_eq!(base64_len(1), 4);
        assert_eq!(base64_len(3), 4);
        assert_eq!(base64_len(4), 8);
        let policy = PushedPolicy::new(&vec![7u8; 5 << 19], "{}");
        let text = policy.wasm_base64.len() as u64;
        assert_eq!(base64_len(policy.size.unwrap()), text);
        assert_eq!(text.div_ceil(CHUNK_BYTES as u64), 4, "2.5 MiB is 4 chunks");
        assert_eq!(base64_len(u64::MAX), u64::MAX, "saturates");
    }

    #[test]
    fn a_signature_says_whether_the_push_is_live_or_a_shadow() {
        let dir = tempfile::tempdir().unwrap();
        let trusted = vec![SigningKey::generate(&dir.path().join("ops")).unwrap()];
        let key = SigningKey::load(&dir.path().join("ops")).unwrap();
        let ep: EndpointPath = "default/llama/generate".parse().unwrap();
        let mut live = PushedPolicy::new(b"\0asm", "{}");
        live.sign(&ep, &key);
        assert_eq!(live.role(), Role::Live);
        assert!(live.verify(&ep, &trusted).is_ok());
        // The same signed push made into a shadow (or its sample changed) fails.
        let as_shadow = PushedPolicy {
            sample: Some(1.0),
            ..live.clone()
        };
        assert!(as_shadow.verify(&ep, &trusted).is_err());
        let mut shadow = PushedPolicy::shadow(b"\0asm", "{}", 0.5);
        shadow.sign(&ep, &key);
        assert_eq!(shadow.role(), Role::Shadow);
        assert!(shadow.verify(&ep, &trusted).is_ok());
        let resampled = PushedPolicy {
            sample: Some(1.0),
            ..shadow.clone()
        };
        assert!(resampled.verify(&ep, &trusted).is_err());
        let as_live = PushedPolicy {
            sample: None,
            ..shadow
        };
        assert!(as_live.verify(&ep, &trusted).is_err());
    }

    #[test]
    fn a_router_with_trusted_keys_applies_only_pushes_they_signed_for_that_endpoint() {
        let dir = tempfile::tempdir().unwrap();
        let ops = dir.path().join("ops");
        let trusted = vec![SigningKey::generate(&ops).unwrap()];
        let key = SigningKey::load(&ops).unwrap();
        SigningKey::generate(&dir.path().join("stranger")).unwrap();
        let stranger = SigningKey::load(&dir.path().join("stranger")).unwrap();
        let a: EndpointPath = "default/llama/generate".parse().unwrap();
        let b: EndpointPath = "default/other/generate".parse().unwrap();

        let unsigned = PushedPolicy::new(b"\0asm policy", "{}");
        assert!(
            unsigned.verify(&a, &[]).is_ok(),
            "no keys: nothing required"
        );
        let why = unsigned.verify(&a, &trusted).unwrap_err();
        assert!(why.contains("not signed"), "{why}");

        let mut signed = unsigned.clone();
        signed.sign(&a, &key);
        assert_eq!(signed.verify(&a, &trusted), Ok(()));
        // Survives storage as JSON.
        let stored: PushedPolicy =
            serde_json::from_str(&serde_json::to_string(&signed).unwrap()).unwrap();
        assert_eq!(stored.verify(&a, &trusted), Ok(()));
        let why = signed.verify(&b, &trusted).unwrap_err();
        assert!(why.contains("does not verify"), "{why}");

        let mut reconfigured = signed.clone();
        reconfigured.config = r#"{"overlap_weight": 0}"#.into();
        assert!(reconfigured.verify(&a, &trusted).is_err());
        // The size is signed: an etcd writer can neither change it nor strip it (the
        // chunk count is checked against it before any chunk is read).
        for size in [Some(1 << 30), None] {
            let mut resized = signed.clone();
            resized.size = size;
            assert!(resized.verify(&a, &trusted).is_err(), "{size:?}");
        }
        let mut swapped = signed.clone();
        swapped.sha256 = hex(&Sha256::digest(b"other"));
        assert!(swapped.verify(&a, &trusted).is_err());

        let mut foreign = unsigned.clone();
        foreign.sign(&a, &stranger);
        let why = foreign.verify(&a, &trusted).unwrap_err();
        assert!(why.contains("does not trust"), "{why}");
        // Claiming a trusted signer does not help a stranger's signature.
        foreign.signer = Some(trusted[0].to_string());
        assert!(foreign.verify(&a, &trusted).is_err());
    }
}
