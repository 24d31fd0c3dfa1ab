"""shards"""
