"""astream.policies"""
