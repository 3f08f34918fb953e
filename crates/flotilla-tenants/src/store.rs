//! Tenant records: KV bucket `<prefix>-tenants` of the deployment's default installation,
//! one key per tenant, written by the platform's operator (`flotilla tenant add`).

use async_nats::jetstream::kv;
use flotilla_bus::Bus;
use flotilla_model::tenant::{TenantName, TenantRecord};
use futures::TryStreamExt;

use crate::error::{TenantError, TenantErrorKind};

/// The bucket's name under the deployment's prefix.
pub fn bucket_name(base: &str) -> String {
    format!("{base}-tenants")
}

/// The tenant records of a deployment.
#[derive(Clone)]
pub struct TenantStore {
    kv: kv::Store,
}

impl std::fmt::Debug for TenantStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TenantStore")
            .field("bucket", &self.kv.name)
            .finish()
    }
}

impl TenantStore {
    /// Opens the bucket, creating it when `create` (the operator's `tenant add`).
    pub async fn open(bus: &Bus, create: bool) -> Result<Self, TenantError> {
        let name = bucket_name(bus.names().prefix());
        let kv = match bus.js().get_key_value(&name).await {
            Ok(kv) => kv,
            Err(_) if create => bus
                .js()
                .create_key_value(kv::Config {
                    bucket: name.clone(),
                    description: "Flotilla tenants (flotilla tenant add)".into(),
                    history: 5,
                    ..Default::default()
                })
                .await
                .map_err(|e| TenantError::nats(format!("creating bucket {name}"), e))?,
            Err(e) => {
                return Err(TenantError::new(
                    TenantErrorKind::NoTenants,
                    format!("no tenant bucket {name}: no tenant was added ({e})"),
                ));
            }
        };
        Ok(Self { kv })
    }

    /// Adds `record`; a tenant of that name already there is `already_exists`.
    pub async fn add(&self, record: &TenantRecord) -> Result<(), TenantError> {
        let body = encode(record)?;
        self.kv
            .create(record.name.as_str(), body.into())
            .await
            .map_err(|e| match e.kind() {
                kv::CreateErrorKind::AlreadyExists => TenantError::new(
                    TenantErrorKind::AlreadyExists,
                    format!("tenant {} already exists", record.name),
                ),
                _ => TenantError::nats(format!("adding tenant {}", record.name), e),
            })?;
        Ok(())
    }

    /// Replaces `record` (quotas, pools, people changed).
    pub async fn put(&self, record: &TenantRecord) -> Result<(), TenantError> {
        let body = encode(record)?;
        self.kv
            .put(record.name.as_str(), body.into())
            .await
            .map_err(|e| TenantError::nats(format!("writing tenant {}", record.name), e))?;
        Ok(())
    }

    /// The tenant `name`, if it exists.
    pub async fn get(&self, name: &TenantName) -> Result<Option<TenantRecord>, TenantError> {
        let Some(bytes) = self
            .kv
            .get(name.as_str())
            .await
            .map_err(|e| TenantError::nats(format!("reading tenant {name}"), e))?
        else {
            return Ok(None);
        };
        serde_json::from_slice(&bytes).map(Some).map_err(|e| {
            TenantError::new(
                TenantErrorKind::Decode,
                format!("tenant {name}'s record cannot be read: {e}"),
            )
        })
    }

    /// Every tenant, by name.
    pub async fn list(&self) -> Result<Vec<TenantRecord>, TenantError> {
        let keys: Vec<String> = match self.kv.keys().await {
            Ok(keys) => keys
                .try_collect()
                .await
                .map_err(|e| TenantError::nats("listing tenants", e))?,
            Err(e) => return Err(TenantError::nats("listing tenants", e)),
        };
        let mut out = Vec::new();
        for k in keys {
            let Ok(name) = TenantName::new(&k) else {
                continue;
            };
            if let Some(r) = self.get(&name).await? {
                out.push(r);
            }
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    /// Removes tenant `name`'s record; `false` when there was none.
    pub async fn remove(&self, name: &TenantName) -> Result<bool, TenantError> {
        if self.get(name).await?.is_none() {
            return Ok(false);
        }
        self.kv
            .purge(name.as_str())
            .await
            .map_err(|e| TenantError::nats(format!("removing tenant {name}"), e))?;
        Ok(true)
    }
}

fn encode(record: &TenantRecord) -> Result<Vec<u8>, TenantError> {
    serde_json::to_vec(record).map_err(|e| {
        TenantError::new(
            TenantErrorKind::Decode,
            format!("encoding tenant {}: {e}", record.name),
        )
    })
}
