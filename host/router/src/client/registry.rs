//! Exactly one [`Client`] per endpoint, shared by everyone who routes to it.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::{Client, ClientConfig, HealthCheck};
use switchyard_discovery::{Discovery, EndpointPath};

/// Creates each endpoint's `Client` once, wires it to discovery, and hands the same
/// `Arc` to every caller: the KV router and the proxy can never see different sets.
pub struct ClientRegistry {
    discovery: Arc<dyn Discovery>,
    health: Arc<dyn HealthCheck>,
    config: ClientConfig,
    /// Held only to look up or insert; creating a client spawns tasks but never awaits.
    clients: Mutex<HashMap<EndpointPath, Arc<Client>>>,
}

impl ClientRegistry {
    /// A registry fed by `discovery`, probing down instances with `health`.
    pub fn new(
        discovery: Arc<dyn Discovery>,
        health: Arc<dyn HealthCheck>,
        config: ClientConfig,
    ) -> ClientRegistry {
        ClientRegistry {
            discovery,
            health,
            config,
            clients: Mutex::new(HashMap::new()),
        }
    }

    /// The endpoint's client, created (and subscribed to discovery) on first use.
    /// Must be called inside a Tokio runtime.
    pub fn client(&self, endpoint: &EndpointPath) -> Arc<Client> {
        let mut clients = self.clients.lock();
        if let Some(c) = clients.get(endpoint) {
            return c.clone();
        }
        let client = Client::new(endpoint.clone(), self.config.clone(), self.health.clone());
        let (tx, mut rx) = mpsc::unbounded_channel();
        self.discovery.watch(endpoint.clone(), tx);
        let weak = Arc::downgrade(&client);
        // Ends within a second of the client being dropped (released); dropping `rx` then
        // ends the discovery task and its etcd watch.
        tokio::spawn(async move {
            let mut check = tokio::time::interval(std::time::Duration::from_secs(1));
            loop {
                tokio::select! {
                    update = rx.recv() => {
                        let (Some(update), Some(client)) = (update, weak.upgrade()) else {
                            return;
                        };
                        client.apply(update);
                    }
                    _ = check.tick() => {
                        if weak.strong_count() == 0 {
                            return;
                        }
                    }
                }
            }
        });
        clients.insert(endpoint.clone(), client.clone());
        client
    }

    /// Forgets `endpoint`'s client: once its last user lets go, its discovery watch and
    /// health probes end. Returns whether there was one.
    pub fn release(&self, endpoint: &EndpointPath) -> bool {
        self.clients.lock().remove(endpoint).is_some()
    }

    /// Every client created so far.
    pub fn clients(&self) -> Vec<Arc<Client>> {
        self.clients.lock().values().cloned().collect()
    }
}
