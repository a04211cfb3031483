//! Schema migrations whose bookkeeping lives in the component's own schema.
//!
//! sqlx keeps its migration history in `public._sqlx_migrations` by default. That table belongs to
//! whoever migrated first: an application that runs its own sqlx migrations already has one, and
//! two migrators sharing it refuse each other's history ("previously applied but is missing");
//! since Postgres 15 a role that does not own `public` cannot create it either. So each handoff
//! component keeps its history next to its tables: `handoff._sqlx_migrations` for the relay's
//! schema, `handoff_consumer._sqlx_migrations` for the consumer's.
//!
//! Installs made before this change recorded their migrations in `public._sqlx_migrations`.
//! [`Schema::migrate`] adopts those rows first: the ones whose version and checksum are exactly one
//! of this component's migrations move to the component's table, in one transaction; anything else
//! in the public table (an application's history) is left alone.

use sqlx::migrate::{MigrateError, Migrator};
use sqlx::{AssertSqlSafe, PgPool};

/// Whether a service applies pending migrations when it starts.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum MigrateMode {
    /// Apply pending migrations at startup (concurrent starts serialize on an advisory lock).
    #[default]
    Auto,
    /// Never change the schema; refuse to start while it is behind this binary (run the `migrate`
    /// subcommand, e.g. as a Kubernetes Job, with a role that may change the schema).
    Never,
}

/// One component's schema and its migrations.
#[derive(Debug)]
pub struct Schema {
    name: &'static str,
    migrator: Migrator,
}

/// Why a service refused to start with `--migrate never`.
#[derive(Debug, thiserror::Error)]
pub enum SchemaError {
    #[error(
        "schema {schema} is at {applied}, this binary needs {needed}: run `{binary} migrate` \
         (or start with --migrate auto / HANDOFF_MIGRATE=auto)"
    )]
    Behind { schema: &'static str, binary: &'static str, applied: String, needed: i64 },
    #[error("reading the migration history of schema {schema}")]
    Read {
        schema: &'static str,
        #[source]
        source: sqlx::Error,
    },
}

/// What [`Schema::migrate`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migrated {
    /// History rows moved from `public._sqlx_migrations` (an install from before this change).
    pub adopted: u64,
    /// The version the schema is at now.
    pub version: i64,
    /// The schema is ahead of this binary (a newer one migrated it, as in a rolling upgrade):
    /// every migration this binary embeds is applied, and nothing was run.
    pub ahead: bool,
}

impl Schema {
    /// `migrator` (from `sqlx::migrate!`) with its bookkeeping in `<name>._sqlx_migrations`.
    pub fn new(name: &'static str, mut migrator: Migrator) -> Self {
        migrator.dangerous_set_table_name(format!("{name}._sqlx_migrations"));
        migrator.create_schema(name);
        Self { name, migrator }
    }

    /// The schema's name.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The bookkeeping table, schema-qualified.
    pub fn table(&self) -> String {
        format!("{}._sqlx_migrations", self.name)
    }

    /// The migrator (bookkeeping already in the schema), e.g. for `run_to` in upgrade tests.
    pub fn migrator(&self) -> &Migrator {
        &self.migrator
    }

    /// The newest migration this binary embeds.
    pub fn latest(&self) -> i64 {
        self.migrator.iter().map(|m| m.version).max().unwrap_or(0)
    }

    /// Adopts history from `public._sqlx_migrations` (see the module docs), then applies every
    /// pending migration. Safe to run from several processes at once.
    ///
    /// A schema ahead of this binary (newer migrations applied, and every one this binary embeds
    /// applied with the same checksum) is left as it is, as `--migrate never` accepts it: an older
    /// binary keeps running while a rolling upgrade replaces it. sqlx itself would refuse the
    /// newer history ("previously applied but missing").
    pub async fn migrate(&self, pool: &PgPool) -> Result<Migrated, MigrateError> {
        let adopted = self.adopt_public_history(pool).await?;
        if let Some(version) = self.ahead_of_this_binary(pool).await? {
            tracing::info!(
                schema = self.name,
                version,
                binary_latest = self.latest(),
                "schema is ahead of this binary (a newer one migrated it); nothing to apply"
            );
            return Ok(Migrated { adopted, version, ahead: true });
        }
        self.migrator.run(pool).await?;
        let version = self.applied(pool).await?.unwrap_or(0);
        Ok(Migrated { adopted, version, ahead: false })
    }

    /// The applied version when it is newer than this binary's newest and every embedded
    /// migration is applied with its checksum; otherwise `None` (the migrator decides, and reports
    /// any gap or changed migration).
    async fn ahead_of_this_binary(&self, pool: &PgPool) -> Result<Option<i64>, sqlx::Error> {
        let Some(applied) = self.applied(pool).await? else { return Ok(None) };
        if applied <= self.latest() {
            return Ok(None);
        }
        let history: Vec<(i64, Vec<u8>)> =
            sqlx::query_as(AssertSqlSafe(format!("SELECT version, checksum FROM {} WHERE success", self.table())))
                .fetch_all(pool)
                .await?;
        let history: std::collections::HashMap<i64, Vec<u8>> = history.into_iter().collect();
        let all_ours = self
            .migrator
            .iter()
            .all(|m| history.get(&m.version).is_some_and(|checksum| checksum.as_slice() == &*m.checksum));
        Ok(all_ours.then_some(applied))
    }

    /// The newest applied migration, or `None` when the schema has no history yet.
    pub async fn applied(&self, pool: &PgPool) -> Result<Option<i64>, sqlx::Error> {
        let exists: bool =
            sqlx::query_scalar("SELECT to_regclass($1) IS NOT NULL").bind(self.table()).fetch_one(pool).await?;
        if !exists {
            return Ok(None);
        }
        sqlx::query_scalar(AssertSqlSafe(format!("SELECT max(version) FROM {} WHERE success", self.table())))
            .fetch_one(pool)
            .await
    }

    /// What a service does with its schema at startup: migrate (`Auto`), or check that it is
    /// current (`Never`, failing with what to run). Returns the version the schema is at.
    pub async fn prepare(&self, pool: &PgPool, mode: MigrateMode, binary: &'static str) -> anyhow::Result<i64> {
        let version = match mode {
            MigrateMode::Auto => self.migrate(pool).await?.version,
            MigrateMode::Never => self.require_current(pool, binary).await?,
        };
        tracing::info!(schema = self.name, version, ?mode, "schema ready");
        Ok(version)
    }

    /// Fails, saying what to run, unless every migration this binary embeds is applied.
    pub async fn require_current(&self, pool: &PgPool, binary: &'static str) -> Result<i64, SchemaError> {
        let applied = self.applied(pool).await.map_err(|source| SchemaError::Read { schema: self.name, source })?;
        match applied {
            Some(version) if version >= self.latest() => Ok(version),
            other => Err(SchemaError::Behind {
                schema: self.name,
                binary,
                applied: other.map_or("no version (never migrated)".into(), |v| format!("version {v}")),
                needed: self.latest(),
            }),
        }
    }

    /// Moves this component's rows out of `public._sqlx_migrations` into its own table, matching
    /// version and checksum exactly, in one transaction under a transaction-level advisory lock (so
    /// two processes upgrading at once move each row once). Returns how many rows moved.
    async fn adopt_public_history(&self, pool: &PgPool) -> Result<u64, MigrateError> {
        let mut tx = pool.begin().await?;
        let public: bool =
            sqlx::query_scalar("SELECT to_regclass('public._sqlx_migrations') IS NOT NULL").fetch_one(&mut *tx).await?;
        if !public {
            return Ok(0);
        }
        sqlx::query("SELECT pg_advisory_xact_lock(hashtext('handoff: adopt migration history'))")
            .execute(&mut *tx)
            .await?;
        let versions: Vec<i64> = self.migrator.iter().map(|m| m.version).collect();
        let checksums: Vec<Vec<u8>> = self.migrator.iter().map(|m| m.checksum.to_vec()).collect();
        let ours: i64 = sqlx::query_scalar(
            r#"SELECT count(*) FROM public._sqlx_migrations AS p
                 JOIN UNNEST($1::bigint[], $2::bytea[]) AS o(version, checksum)
                   ON p.version = o.version AND p.checksum = o.checksum"#,
        )
        .bind(&versions)
        .bind(&checksums)
        .fetch_one(&mut *tx)
        .await?;
        if ours == 0 {
            return Ok(0);
        }
        // The same table sqlx creates, so its migrator reads the moved rows as its own.
        sqlx::raw_sql(AssertSqlSafe(format!(
            r#"CREATE SCHEMA IF NOT EXISTS {schema};
               CREATE TABLE IF NOT EXISTS {table} (
                   version BIGINT PRIMARY KEY,
                   description TEXT NOT NULL,
                   installed_on TIMESTAMPTZ NOT NULL DEFAULT now(),
                   success BOOLEAN NOT NULL,
                   checksum BYTEA NOT NULL,
                   execution_time BIGINT NOT NULL
               );"#,
            schema = self.name,
            table = self.table()
        )))
        .execute(&mut *tx)
        .await?;
        let moved = sqlx::query(AssertSqlSafe(format!(
            r#"WITH moved AS (
                   DELETE FROM public._sqlx_migrations AS p
                    USING UNNEST($1::bigint[], $2::bytea[]) AS o(version, checksum)
                    WHERE p.version = o.version AND p.checksum = o.checksum
                RETURNING p.version, p.description, p.installed_on, p.success, p.checksum, p.execution_time
               )
               INSERT INTO {table} (version, description, installed_on, success, checksum, execution_time)
               SELECT * FROM moved
               ON CONFLICT (version) DO NOTHING"#,
            table = self.table()
        )))
        .bind(&versions)
        .bind(&checksums)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        tracing::info!(
            schema = self.name,
            rows = moved,
            "moved this schema's migration history out of public._sqlx_migrations"
        );
        Ok(moved)
    }
}
