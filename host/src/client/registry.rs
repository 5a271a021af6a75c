//! Exactly one [`Client`] per endpoint, shared by everyone who routes to it.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::Mutex;
use tokio::sync::mpsc;

use super::{Client, ClientConfig, HealthCheck};
use crate::discovery::{Discovery, EndpointPath};

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
        // Ends when the client is dropped; dropping `rx` then ends the discovery task.
        tokio::spawn(async move {
            while let Some(update) = rx.recv().await {
                let Some(client) = weak.upgrade() else { return };
                client.apply(update);
            }
        });
        clients.insert(endpoint.clone(), client.clone());
        client
    }

    /// Every client created so far.
    pub fn clients(&self) -> Vec<Arc<Client>> {
        self.clients.lock().values().cloned().collect()
    }
}
