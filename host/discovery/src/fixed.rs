//! Static discovery: instances given on the command line or in the config file. The
//! embedded default; needs no external service. The set never changes, so a reported-down
//! instance returns only through its health probe.

use tokio::sync::mpsc;

use super::{Discovery, DiscoveryUpdate, EndpointPath, InstanceInfo};

/// A fixed list of instances.
#[derive(Debug, Clone, Default)]
pub struct FixedDiscovery {
    instances: Vec<InstanceInfo>,
}

impl FixedDiscovery {
    /// Serves `instances` (each to its own endpoint).
    pub fn new(instances: Vec<InstanceInfo>) -> FixedDiscovery {
        FixedDiscovery { instances }
    }

    /// Every instance, for listing.
    pub fn instances(&self) -> &[InstanceInfo] {
        &self.instances
    }
}

impl Discovery for FixedDiscovery {
    fn watch(
        &self,
        endpoint: EndpointPath,
        tx: mpsc::UnboundedSender<DiscoveryUpdate>,
    ) -> tokio::task::JoinHandle<()> {
        let set: Vec<InstanceInfo> = self
            .instances
            .iter()
            .filter(|i| i.endpoint == endpoint)
            .cloned()
            .collect();
        tokio::spawn(async move {
            if tx.send(DiscoveryUpdate::Reset(set)).is_ok() {
                tx.closed().await;
            }
        })
    }
}
