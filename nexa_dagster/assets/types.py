"""Dagster types for the tables that cross stage boundaries, made from the pandera schemas in the core."""

from dagster_pandera import pandera_schema_to_dagster_type  # beta: nexa_dagster/dagster_warnings.py says why

from nexa_dagster.core.data import schemas

RawDocumentsType = pandera_schema_to_dagster_type(schemas.RawDocuments)
TeacherSamplesType = pandera_schema_to_dagster_type(schemas.TeacherSamples)
FilteredSamplesType = pandera_schema_to_dagster_type(schemas.FilteredSamples)
RejectedSamplesType = pandera_schema_to_dagster_type(schemas.RejectedSamples)
LeaderboardType = pandera_schema_to_dagster_type(schemas.Leaderboard)
PreferencePairsType = pandera_schema_to_dagster_type(schemas.PreferencePairs)
